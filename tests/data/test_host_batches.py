"""Each process's rows of the global batch, read ahead off the training thread, and the
data position: saved after some steps and restored in another layout (or batch size), it
reads exactly the rows the uninterrupted run reads.

The processes of a multi-process run are stood for by sets of the 8 devices: a
:class:`HostBatches` reads the rows of the devices it is given."""

import threading

import numpy as np
from jax.sharding import NamedSharding

from jaxmoe.config import ParallelConfig
from jaxmoe.data.batches import BatchSampler, put_on_mesh
from jaxmoe.data.host_batches import DataPosition, HostBatches, held_rows
from jaxmoe.data.mixture import mixed_examples
from jaxmoe.parallel.mesh import build_mesh, token_spec

SEQ_LEN, BATCH = 8, 16


def mixture(read: list | None = None) -> BatchSampler:
    """Two corpora, 3 : 1, as global batches of 16; ``read`` collects (example, thread)
    of every example read."""
    parts = [np.arange(3000, dtype=np.uint16), np.arange(3000, dtype=np.uint16) + 5000]
    examples = mixed_examples(parts, [3.0, 1.0], SEQ_LEN, seed=11)
    if read is not None:

        def record(index, row):
            read.append((index, threading.current_thread().name))
            return row

        examples = examples.map_with_index(record)
    return BatchSampler(examples, SEQ_LEN, BATCH)


def sharding(data: int, expert: int) -> NamedSharding:
    mesh = build_mesh(ParallelConfig(data=data, expert=expert))
    return NamedSharding(mesh, token_spec(mesh))


def hosts(layout: NamedSharding, count: int) -> list[list]:
    """The mesh's devices cut into ``count`` processes of neighbouring devices."""
    devices = list(layout.mesh.devices.flat)
    size = len(devices) // count
    return [devices[i * size : (i + 1) * size] for i in range(count)]


def test_each_host_reads_its_rows_of_the_global_batch_and_no_other():
    layout = sharding(2, 4)
    expected = mixture()
    seen = []
    for devices in hosts(layout, 2):
        read = []
        with HostBatches(mixture(read), layout.mesh, DataPosition(), 0, devices) as batches:
            for step in range(3):
                np.testing.assert_array_equal(
                    batches.next_rows(), expected.rows(step)[list(batches.rows)]
                )
        assert sorted(index for index, _ in read) == [
            step * BATCH + row for step in range(3) for row in batches.rows
        ]
        seen += batches.rows
    assert sorted(seen) == list(range(BATCH))  # together, the whole batch, each row once


def test_the_global_batch_on_the_mesh_is_the_samplers():
    layout = sharding(2, 4)
    with HostBatches(mixture(), layout.mesh, DataPosition(), 2) as batches:
        assert batches.rows == tuple(range(BATCH))  # one process holds every row
        for step in range(2):
            batch = batches.next_on_mesh()
            assert batch.sharding == layout
            np.testing.assert_array_equal(batch, put_on_mesh(mixture(), step, layout.mesh))


def test_rows_are_read_ahead_on_grains_threads_and_the_position_counts_those_taken():
    read = []
    with HostBatches(mixture(read), sharding(2, 4).mesh, DataPosition(32), 2) as batches:
        assert batches.position == DataPosition(32)
        batches.next_rows()
        assert batches.position == DataPosition(48)  # what was read ahead does not count
    threads = {thread for _, thread in read}
    assert threads and all(thread.startswith("grain-prefetch") for thread in threads)
    on_caller = []
    with HostBatches(mixture(on_caller), sharding(2, 4).mesh, DataPosition(), 0) as batches:
        batches.next_rows()
    assert {thread for _, thread in on_caller} == {threading.current_thread().name}


def test_a_position_restored_in_another_layout_reads_the_uninterrupted_runs_rows():
    expected = mixture()
    # Two processes of data 2 x expert 4 read two steps and save where they stand.
    before = sharding(2, 4)
    positions = set()
    for devices in hosts(before, 2):
        with HostBatches(mixture(), before.mesh, DataPosition(), 2, devices) as batches:
            batches.next_rows(), batches.next_rows()
            positions.add(batches.position)
    (position,) = positions  # the same on every process
    saved = {"seed": 0, **position.to_json()}
    # Four processes of data 4 x expert 2 go on from it: steps 2 and 3 of the run.
    after = sharding(4, 2)
    restored = DataPosition.saved(saved, step=2, global_batch=BATCH)
    for devices in hosts(after, 4):
        with HostBatches(mixture(), after.mesh, restored, 2, devices) as batches:
            assert len(batches.rows) == BATCH // 4
            for step in (2, 3):
                np.testing.assert_array_equal(
                    batches.next_rows(), expected.rows(step)[list(batches.rows)]
                )
    # With half the batch size, the next unread examples: 32 .. 39, not 16 .. 23.
    halves = BatchSampler(expected.examples, SEQ_LEN, BATCH // 2)
    with HostBatches(halves, after.mesh, restored, 0) as batches:
        np.testing.assert_array_equal(batches.next_rows(), expected.rows(2)[: BATCH // 2])


def test_a_checkpoint_saved_before_positions_were_stands_after_its_steps():
    assert DataPosition.saved({"seed": 0, "next_batch": 3}, step=3, global_batch=8) == (
        DataPosition(24)
    )
    assert DataPosition.saved({"next_example": 20}, step=3, global_batch=8) == DataPosition(20)


def test_held_rows_follow_the_mesh_whatever_its_device_order():
    layout = sharding(2, 4)
    by_device = layout.devices_indices_map((BATCH, 1))
    for devices in hosts(layout, 4):
        rows = held_rows(layout, BATCH, devices)
        assert rows == tuple(
            sorted(row for device in devices for row in range(BATCH)[by_device[device][0]])
        )
