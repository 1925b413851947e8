"""One process's rows of each step's global batch, read ahead by Grain's threads, and the
position a checkpoint keeps.

The run's training examples are one global sequence, example ``i`` a pure function of
``i`` (:mod:`jaxmoe.data.mixture`). Where the input stands is therefore one number, the
index of the next example (:class:`DataPosition`): the same on every process and in any
layout. From a position, step ``k`` (counted from it) reads examples ``position + k B ..
position + k B + B - 1``, and a process reads only the rows of those its own devices
hold (:func:`held_rows`): a Grain selection of the global sequence, batched per step and
read ahead by Grain's prefetch threads while the step runs (:class:`HostBatches`). A run
resumed on another mesh or process count reads, from the saved position, exactly the rows
the uninterrupted run would have; one resumed with another batch size goes on from the
next unread example.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxmoe.data.batches import BatchSampler
from jaxmoe.parallel.mesh import token_spec


@dataclass(frozen=True)
class DataPosition:
    """The index of the next example of the run's global sequence."""

    next_example: int = 0

    def to_json(self) -> dict[str, int]:
        return {"next_example": self.next_example}

    @classmethod
    def saved(cls, data: Mapping[str, Any], step: int, global_batch: int) -> DataPosition:
        """The position a checkpoint saved (its ``data`` record) after ``step`` steps; one
        saved before positions were (none in the record) stands after ``step`` batches
        of ``global_batch`` examples."""
        if "next_example" in data:
            return cls(int(data["next_example"]))
        return cls(step * global_batch)


def held_rows(
    sharding: NamedSharding, global_batch: int, devices: Iterable[jax.Device] | None = None
) -> tuple[int, ...]:
    """The rows of a ``[global_batch, ...]`` array under ``sharding`` that ``devices``
    (default: this process's) hold, ascending, each once."""
    devices = set(sharding.addressable_devices if devices is None else devices)
    index_map = sharding.devices_indices_map((global_batch, 1))
    rows = set()
    for device, index in index_map.items():
        if device in devices:
            rows.update(range(*index[0].indices(global_batch)))
    return tuple(sorted(rows))


class _HeldExamples(grain.transforms.DatasetSelectionMap):
    """Row ``j`` that a process reads -> the example of the global sequence it is; without
    end, as the sequence."""

    def __init__(self, first_example: int, global_batch: int, rows: Sequence[int]):
        self._first = first_example
        self._batch = global_batch
        self._rows = tuple(rows)

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> tuple[int, int]:
        step, row = divmod(index, len(self._rows))
        return 0, self._first + step * self._batch + self._rows[row]


class HostBatches:
    """This process's rows of the global batches from ``start`` on, sharded over the token
    axes of ``mesh``, read ahead by ``prefetch`` Grain threads (0: on the caller's thread,
    when asked for).

    ``devices``: whose rows to read (default: this process's devices); any other set only
    for :meth:`next_rows`, not for :meth:`next_on_mesh`.
    """

    def __init__(
        self,
        batches: BatchSampler,
        mesh: Mesh,
        start: DataPosition,
        prefetch: int,
        devices: Iterable[jax.Device] | None = None,
    ):
        self.sharding = NamedSharding(mesh, token_spec(mesh))
        self.start = start
        self.global_batch = batches.global_batch
        self.shape = (batches.global_batch, batches.seq_len + 1)
        self.rows = held_rows(self.sharding, batches.global_batch, devices)
        self._place = {row: place for place, row in enumerate(self.rows)}
        held = _HeldExamples(start.next_example, batches.global_batch, self.rows)
        per_step = grain.MapDataset.select_from_datasets([batches.examples], held).batch(
            len(self.rows)
        )
        read = grain.ReadOptions(num_threads=prefetch, prefetch_buffer_size=prefetch)
        self._iterator = iter(per_step.to_iter_dataset(read))
        self._iterator.start_prefetch()

    @property
    def position(self) -> DataPosition:
        """Where the input stands after the batches taken so far (not those read ahead):
        Grain's iterator state counts the elements it has returned."""
        taken = self._iterator.get_state()["next_index"]
        return DataPosition(self.start.next_example + taken * self.global_batch)

    def next_rows(self) -> np.ndarray:
        """The held rows of the next step's batch, int32 ``[len(rows), S + 1]``."""
        return next(self._iterator)

    def next_on_mesh(self) -> jax.Array:
        """The next step's global batch, sharded over the token axes: this process's rows
        read, the others' left to them."""
        held = self.next_rows()

        def rows_of(index: tuple[slice, ...]) -> np.ndarray:
            first, stop, _ = index[0].indices(self.global_batch)
            place = self._place[first]
            return held[(slice(place, place + stop - first), *index[1:])]

        return jax.make_array_from_callback(self.shape, self.sharding, rows_of)

    def close(self) -> None:
        """Stop the read-ahead threads."""
        self._iterator.close()

    def __enter__(self) -> HostBatches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
