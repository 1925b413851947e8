"""Training text: a corpus, its train/validation split, its sequences, and batches on the mesh.

The default corpus is real text that every Python install carries: the source
files of the standard library, read in sorted path order, as bytes (the
token ids are byte values, vocabulary 256). A source of ``data.sources`` is a text
file (bytes again) or a ``.bin`` (any case) of little-endian token ids: with a
sidecar ``NAME.json`` (what ``jaxmoe data`` writes, :mod:`jaxmoe.data.corpus`) in the
sidecar's dtype (uint16 or uint32), its vocabulary and end-of-document id known;
without one, uint16 ids. A ``.bin`` is memory-mapped, not read whole.

A split's sequences are its windows of ``seq_len + 1`` tokens at a stride of
``seq_len`` (:class:`TokenWindows`: every token is an input once), a random-access source
for Grain; :mod:`jaxmoe.data.mixture` shuffles and mixes them into the run's global
sequence of examples. A :class:`BatchSampler` cuts that sequence into global batches,
batch ``k`` being examples ``k B .. k B + B - 1``, so that which rows form a batch depends
only on the seed and the batch's index, on any mesh or process count; :func:`put_on_mesh`
has each process build only its own rows of one.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxmoe.config import ConfigError
from jaxmoe.data.corpus import CorpusInfo, read_info
from jaxmoe.parallel.mesh import token_spec


def stdlib_source_files() -> Iterator[Path]:
    """The standard library's ``.py`` files in the order of their paths relative to it,
    without installed third-party packages; walked lazily, so a corpus of its first bytes
    reads only the directories it needs."""
    root = Path(sysconfig.get_paths()["stdlib"])

    def walk(directory: Path) -> Iterator[Path]:
        # A directory's entries in the order of the paths under them: a directory's name
        # with its separator ("a/" sorts after "a.py" and before "a0"), a file's as it is.
        entries = [entry for entry in directory.iterdir() if entry.name != "site-packages"]
        for entry in sorted(entries, key=lambda e: e.name + "/" if e.is_dir() else e.name):
            if entry.is_dir():
                yield from walk(entry)
            elif entry.suffix == ".py" and entry.is_file():
                yield entry

    return walk(root)


def _read_stdlib(max_bytes: int | None) -> np.ndarray:
    chunks, total = [], 0
    for path in stdlib_source_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def _where(path: str) -> str:
    return f"data.sources: {path!r}"


def _check_file(path: str) -> Path:
    """``path``, a file; ConfigError saying why not."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"{_where(path)} is a directory; give a text file or a .bin of token ids")
    if not file.exists():
        raise ConfigError(f"{_where(path)}: no such file; give a text file or a .bin of token ids")
    return file


def _cannot_read(path: str, error: OSError) -> ConfigError:
    return ConfigError(f"{_where(path)}: cannot read it ({error.strerror or error})")


def _read_file(path: str) -> bytes:
    """The bytes of ``path``; ConfigError saying why when it cannot be read."""
    file = _check_file(path)
    try:
        return file.read_bytes()
    except OSError as error:
        raise _cannot_read(path, error) from None


def _map_ids(path: str, dtype: str) -> np.ndarray:
    """The ids of a ``.bin``, memory-mapped read-only (an empty file: no ids)."""
    try:
        if Path(path).stat().st_size == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r")
    except OSError as error:
        raise _cannot_read(path, error) from None


@dataclass(frozen=True)
class Corpus:
    """The token ids of a corpus, and its sidecar's description when it has one."""

    tokens: np.ndarray
    info: CorpusInfo | None = None


def load_corpus(path: str | None, max_bytes: int | None = None) -> Corpus:
    """The corpus at ``path``, a 1-D array of ids (uint16, or the sidecar's dtype); None:
    the standard library's sources, at most ``max_bytes`` of them (``data.max_bytes``)."""
    if path is None:
        return Corpus(_read_stdlib(max_bytes).astype(np.uint16))
    file = _check_file(path)
    if file.suffix.lower() != ".bin":
        return Corpus(np.frombuffer(_read_file(path), dtype=np.uint8).astype(np.uint16))
    info = read_info(file, _where(path))
    if info is not None:
        return Corpus(_map_ids(path, info.numpy_dtype), info)
    try:
        size = file.stat().st_size
    except OSError as error:
        raise _cannot_read(path, error) from None
    if size % 2:
        raise ConfigError(f"{_where(path)}: a .bin must hold uint16 token ids (even byte count)")
    return Corpus(_map_ids(path, "<u2"))


def load_tokens(path: str | None, max_bytes: int | None = None) -> np.ndarray:
    """All token ids of the corpus at ``path`` as a 1-D array (:func:`load_corpus`)."""
    return load_corpus(path, max_bytes).tokens


class TokenSplits:
    """A corpus split into a training head and a validation tail."""

    def __init__(
        self,
        tokens: np.ndarray,
        val_fraction: float,
        seq_len: int,
        info: CorpusInfo | None = None,
        name: str | None = None,
    ):
        self.seq_len = seq_len
        self.info = info
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]
        of = "" if name is None else f" of {name!r}"
        for split_name, part in (("training", self.train), ("validation", self.val)):
            if len(part) < seq_len + 1:
                raise ConfigError(
                    f"the {split_name} split{of} has {len(part)} tokens, fewer than "
                    f"model.seq_len + 1 = {seq_len + 1}: use more data or a different "
                    "data.val_fraction"
                )

    @property
    def max_token_id(self) -> int:
        return int(max(self.train.max(), self.val.max()))

    @property
    def eod_id(self) -> int | None:
        """The end-of-document id (from the corpus's sidecar), None when there is none."""
        return None if self.info is None else self.info.eod_id


class TokenWindows:
    """The sequences of a split, a random-access source for Grain: window ``i`` is tokens
    ``i S .. i S + S`` (``S + 1`` of them, the last the target of the one before), so
    that every token but the last is an input once a pass."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)


class BatchSampler:
    """The global batches of a sequence of examples: batch ``k`` is examples ``k B .. k B
    + B - 1`` of ``examples`` (a Grain MapDataset: index -> int32 ``[S + 1]``), a function
    of the seed and ``k`` only."""

    def __init__(self, examples: grain.MapDataset, seq_len: int, global_batch: int):
        self.examples = examples
        self.seq_len = seq_len
        self.global_batch = global_batch

    def rows(self, step: int, first: int = 0, count: int | None = None) -> np.ndarray:
        """Rows ``first .. first + count`` of batch ``step``, int32 ``[count, S + 1]``."""
        count = self.global_batch - first if count is None else count
        start = step * self.global_batch + first
        return np.stack([self.examples[start + row] for row in range(count)])


def put_on_mesh(sampler: BatchSampler, step: int, mesh: Mesh) -> jax.Array:
    """The global batch of ``step`` as one array sharded over the token axes.

    Each process builds only the rows that its own devices hold, whatever the order
    of the mesh's devices.
    """
    sharding = NamedSharding(mesh, token_spec(mesh))
    shape = (sampler.global_batch, sampler.seq_len + 1)

    def rows_of(index: tuple[slice, ...]) -> np.ndarray:
        rows = index[0]
        first = rows.start or 0
        stop = sampler.global_batch if rows.stop is None else rows.stop
        return sampler.rows(step, first, stop - first)

    return jax.make_array_from_callback(shape, sharding, rows_of)
