"""Training text: the corpus, its train/validation split, and batches on the mesh.

The default corpus is real text that every Python install carries: the source
files of the standard library, read in sorted path order, as bytes (the
token ids are byte values, vocabulary 256). ``DataConfig.path`` takes a text
file (bytes again) or a ``.bin`` (any case) of little-endian token ids: with a
sidecar ``NAME.json`` (what ``jaxmoe data`` writes, :mod:`jaxmoe.data.corpus`) in the
sidecar's dtype (uint16 or uint32), its vocabulary and end-of-document id known;
without one, uint16 ids. A ``.bin`` is memory-mapped, not read whole.
:func:`load_splits` reads and checks it all, so that a bad file is refused
before anything compiles.

Batches are random windows of ``seq_len + 1`` tokens. Which windows form the
global batch of a step depends only on the seed and the step, so runs on
different meshes or process counts see the same data; each process builds
only its own rows.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxmoe.config import Config, ConfigError, DataConfig
from jaxmoe.data.corpus import CorpusInfo, read_info
from jaxmoe.parallel.mesh import token_spec


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without installed third-party packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (
        path
        for path in root.rglob("*.py")
        if "site-packages" not in path.relative_to(root).parts and path.is_file()
    )
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def _read_stdlib(max_bytes: int | None) -> np.ndarray:
    chunks, total = [], 0
    for path in stdlib_source_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def _check_file(data: DataConfig) -> Path:
    """``data.path``, a file; ConfigError saying why not."""
    path = Path(data.path)
    where = f"data.path={data.path!r}"
    if path.is_dir():
        raise ConfigError(f"{where} is a directory; give a text file or a .bin of token ids")
    if not path.exists():
        raise ConfigError(f"{where}: no such file; give a text file or a .bin of token ids")
    return path


def _cannot_read(data: DataConfig, error: OSError) -> ConfigError:
    return ConfigError(f"data.path={data.path!r}: cannot read it ({error.strerror or error})")


def _read_file(data: DataConfig) -> bytes:
    """The bytes of ``data.path``; ConfigError saying why when it cannot be read."""
    path = _check_file(data)
    try:
        return path.read_bytes()
    except OSError as error:
        raise _cannot_read(data, error) from None


def _map_ids(data: DataConfig, path: Path, dtype: str) -> np.ndarray:
    """The ids of a ``.bin``, memory-mapped read-only (an empty file: no ids)."""
    try:
        if path.stat().st_size == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r")
    except OSError as error:
        raise _cannot_read(data, error) from None


@dataclass(frozen=True)
class Corpus:
    """The token ids of a corpus, and its sidecar's description when it has one."""

    tokens: np.ndarray
    info: CorpusInfo | None = None


def load_corpus(data: DataConfig) -> Corpus:
    """The corpus of ``data``: a 1-D array of ids (uint16, or the sidecar's dtype)."""
    if data.path is None:
        return Corpus(_read_stdlib(data.max_bytes).astype(np.uint16))
    path = _check_file(data)
    if path.suffix.lower() != ".bin":
        return Corpus(np.frombuffer(_read_file(data), dtype=np.uint8).astype(np.uint16))
    info = read_info(path, f"data.path={data.path!r}")
    if info is not None:
        return Corpus(_map_ids(data, path, info.numpy_dtype), info)
    try:
        size = path.stat().st_size
    except OSError as error:
        raise _cannot_read(data, error) from None
    if size % 2:
        raise ConfigError(
            f"data.path={data.path!r}: a .bin must hold uint16 token ids (even byte count)"
        )
    return Corpus(_map_ids(data, path, "<u2"))


def load_tokens(data: DataConfig) -> np.ndarray:
    """All token ids of the corpus as a 1-D array (uint16, or uint32 as its sidecar says)."""
    return load_corpus(data).tokens


class TokenSplits:
    """The corpus split into a training head and a validation tail."""

    def __init__(
        self,
        tokens: np.ndarray,
        val_fraction: float,
        seq_len: int,
        info: CorpusInfo | None = None,
    ):
        self.seq_len = seq_len
        self.info = info
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]
        for name, part in (("training", self.train), ("validation", self.val)):
            if len(part) < seq_len + 1:
                raise ConfigError(
                    f"the {name} split has {len(part)} tokens, fewer than model.seq_len + 1 = "
                    f"{seq_len + 1}: use more data or a different data.val_fraction"
                )

    @property
    def max_token_id(self) -> int:
        return int(max(self.train.max(), self.val.max()))

    @property
    def eod_id(self) -> int | None:
        """The end-of-document id (from the corpus's sidecar), None when there is none."""
        return None if self.info is None else self.info.eod_id


def load_splits(config: Config) -> TokenSplits:
    """The corpus of ``config``, split, with every token id inside the vocabulary.

    Raises ConfigError for a file that cannot be read, a malformed ``.bin`` or sidecar,
    too little data for one sequence in either split, a token id (or, with a sidecar, a
    tokenizer's vocabulary) the model cannot embed, or ``data.mask_across_documents``
    without an end-of-document id.
    """
    data, vocab = config.data, config.model.vocab_size
    corpus = load_corpus(data)
    splits = TokenSplits(corpus.tokens, data.val_fraction, config.model.seq_len, corpus.info)
    if corpus.info is not None:  # the sidecar's vocabulary bounds every id: no scan
        if corpus.info.vocab_size > vocab:
            raise ConfigError(
                f"model.vocab_size={vocab}, but the tokenizer of data.path={data.path!r} has "
                f"{corpus.info.vocab_size} tokens: use --model.vocab_size "
                f"{corpus.info.vocab_size} or more"
            )
    elif splits.max_token_id >= vocab:
        raise ConfigError(
            f"model.vocab_size={vocab}, but the data holds token id "
            f"{splits.max_token_id}: use a vocabulary of at least {splits.max_token_id + 1}"
        )
    if data.mask_across_documents and splits.eod_id is None:
        raise ConfigError(
            f"data.mask_across_documents=True, but data.path={data.path!r} has no "
            "end-of-document id (only a .bin with the sidecar that `jaxmoe data` writes has "
            "one): make the corpus with jaxmoe data, or leave the flag out"
        )
    return splits


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens; the global batch is a function of the step."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed

    def _starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.global_batch)

    def rows(self, step: int, first: int = 0, count: int | None = None) -> np.ndarray:
        """Rows ``first .. first + count`` of the batch of ``step``, int32 ``[count, S + 1]``."""
        starts = self._starts(step)[first : None if count is None else first + count]
        offsets = np.arange(self.seq_len + 1)
        return self.tokens[starts[:, None] + offsets].astype(np.int32)


def run_batches(config: Config, splits: TokenSplits) -> tuple[BatchSampler, BatchSampler]:
    """The run's training and validation batches (validation drawn with the next seed)."""
    seq_len, batch, seed = config.model.seq_len, config.train.batch_size, config.train.seed
    return (
        BatchSampler(splits.train, seq_len, batch, seed),
        BatchSampler(splits.val, seq_len, batch, seed + 1),
    )


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
