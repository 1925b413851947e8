"""Training text: the corpus, its train/validation split, and batches on the mesh.

The default corpus is real text that every Python install carries: the source
files of the standard library, read in sorted path order, as bytes (the
token ids are byte values, vocabulary 256). ``DataConfig.path`` takes a text
file (bytes again) or a ``.bin`` (any case) of little-endian uint16 token ids.
:func:`load_splits` reads and checks it all, so that a bad file is refused
before anything compiles.

Batches are random windows of ``seq_len + 1`` tokens. Which windows form the
global batch of a step depends only on the seed and the step, so runs on
different meshes or process counts see the same data; each process builds
only its own rows.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxmoe.config import Config, ConfigError, DataConfig
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


def _read_file(data: DataConfig) -> bytes:
    """The bytes of ``data.path``; ConfigError saying why when it cannot be read."""
    path = Path(data.path)
    where = f"data.path={data.path!r}"
    if path.is_dir():
        raise ConfigError(f"{where} is a directory; give a text file or a .bin of token ids")
    if not path.exists():
        raise ConfigError(f"{where}: no such file; give a text file or a .bin of token ids")
    try:
        return path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{where}: cannot read it ({error.strerror or error})") from None


def load_tokens(data: DataConfig) -> np.ndarray:
    """All token ids of the corpus as a 1-D ``uint16`` array."""
    if data.path is None:
        return _read_stdlib(data.max_bytes).astype(np.uint16)
    content = _read_file(data)
    if Path(data.path).suffix.lower() == ".bin":
        if len(content) % 2:
            raise ConfigError(
                f"data.path={data.path!r}: a .bin must hold uint16 token ids (even byte count)"
            )
        return np.frombuffer(content, dtype="<u2")
    return np.frombuffer(content, dtype=np.uint8).astype(np.uint16)


class TokenSplits:
    """The corpus split into a training head and a validation tail."""

    def __init__(self, tokens: np.ndarray, val_fraction: float, seq_len: int):
        self.seq_len = seq_len
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


def load_splits(config: Config) -> TokenSplits:
    """The corpus of ``config``, split, with every token id inside the vocabulary.

    Raises ConfigError for a file that cannot be read, a malformed ``.bin``, too little
    data for one sequence in either split, or a token id the model cannot embed.
    """
    splits = TokenSplits(load_tokens(config.data), config.data.val_fraction, config.model.seq_len)
    if splits.max_token_id >= config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size}, but the data holds token id "
            f"{splits.max_token_id}: use a vocabulary of at least {splits.max_token_id + 1}"
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
