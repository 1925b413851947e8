"""A token corpus on disk: ``NAME.bin`` and its sidecar ``NAME.json``.

``NAME.bin`` holds the token ids of every document, each followed by the
end-of-document id, little-endian, as ``uint16`` when every id fits (a vocabulary of
at most 65,536) and ``uint32`` otherwise. The sidecar says how to read it::

    {"format": "jaxmoe.corpus", "version": 1, "dtype": "uint16", "vocab_size": 50257,
     "eod_id": 50256, "eod_token": "<|endoftext|>", "tokenizer": "NAME.tokenizer.json",
     "documents": 1200, "tokens": 3456789}

``tokenizer`` is the tokenizer's file, relative to the sidecar's directory (``jaxmoe
data`` copies it there). A ``.bin`` without a sidecar is read as ``uint16`` ids with no
end-of-document id. Nothing here imports JAX.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jaxmoe.config import ConfigError

FORMAT = "jaxmoe.corpus"
VERSION = 1
# dtype name in the sidecar -> NumPy's little-endian type.
DTYPES = {"uint16": "<u2", "uint32": "<u4"}
UINT16_VOCAB = 1 << 16  # ids 0 .. 65535


def dtype_for(vocab_size: int) -> str:
    """The narrowest dtype that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


def sidecar_path(corpus: str | os.PathLike) -> Path:
    """``NAME.json`` next to ``NAME.bin``."""
    return Path(corpus).with_suffix(".json")


def tokenizer_path(corpus: str | os.PathLike) -> Path:
    """``NAME.tokenizer.json`` next to ``NAME.bin``: where ``jaxmoe data`` puts the tokenizer."""
    return Path(corpus).with_suffix(".tokenizer.json")


@dataclass(frozen=True)
class CorpusInfo:
    """What the sidecar of a corpus says."""

    dtype: str
    vocab_size: int
    eod_id: int | None
    eod_token: str | None
    tokenizer: str | None
    documents: int
    tokens: int

    @property
    def numpy_dtype(self) -> str:
        return DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, values: Any) -> CorpusInfo:
        """The sidecar's contents, checked; ValueError saying what is wrong."""
        if not isinstance(values, dict) or values.get("format") != FORMAT:
            raise ValueError(f'not a corpus sidecar (no "format": "{FORMAT}")')
        if values.get("version") != VERSION:
            raise ValueError(f"sidecar version {values.get('version')!r}, this reads {VERSION}")
        missing = [name for name in cls.__dataclass_fields__ if name not in values]
        if missing:
            raise ValueError(f"the sidecar lacks {', '.join(missing)}")
        info = cls(**{name: values[name] for name in cls.__dataclass_fields__})
        if info.dtype not in DTYPES:
            raise ValueError(f"dtype {info.dtype!r}: must be one of {', '.join(DTYPES)}")
        counts = ("vocab_size", "documents", "tokens")
        for name in counts:
            value = getattr(info, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} {value!r}: must be an integer >= 0")
        if info.vocab_size < 1:
            raise ValueError(f"vocab_size {info.vocab_size}: must be at least 1")
        if info.dtype == "uint16" and info.vocab_size > UINT16_VOCAB:
            raise ValueError(f"vocab_size {info.vocab_size} does not fit dtype uint16")
        eod = info.eod_id
        if eod is not None and not (
            isinstance(eod, int) and not isinstance(eod, bool) and 0 <= eod < info.vocab_size
        ):
            raise ValueError(f"eod_id {eod!r}: must be an id below vocab_size, or null")
        for name in ("eod_token", "tokenizer"):
            if not isinstance(getattr(info, name), str | None):
                raise ValueError(f"{name} {getattr(info, name)!r}: must be a string or null")
        return info


def read_info(corpus: str | os.PathLike, where: str) -> CorpusInfo | None:
    """The sidecar of ``corpus``, None when it has none; ConfigError (``where``: ...) when
    the sidecar cannot be read or disagrees with the corpus's size."""
    path = sidecar_path(corpus)
    if not path.is_file():
        return None
    fix = f"write the corpus again with jaxmoe data, or move {path.name} away"
    try:
        info = CorpusInfo.from_json(json.loads(path.read_text()))
    except OSError as error:
        raise ConfigError(f"{where}: cannot read {path.name} ({error.strerror or error})") from None
    except (ValueError, TypeError) as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(
            f"{where}: {path.name} is not a valid sidecar ({reason}); {fix}"
        ) from None
    size = Path(corpus).stat().st_size
    itemsize = 2 if info.dtype == "uint16" else 4
    if size != info.tokens * itemsize:
        raise ConfigError(
            f"{where}: {size} bytes, but {path.name} says {info.tokens} {info.dtype} tokens "
            f"({info.tokens * itemsize} bytes): the corpus is incomplete or not its "
            f"sidecar's; {fix}"
        )
    return info


def write_info(corpus: str | os.PathLike, info: CorpusInfo) -> Path:
    """Write the sidecar of ``corpus`` (atomically); its path."""
    path = sidecar_path(corpus)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(info.to_json(), indent=2) + "\n")
    os.replace(partial, path)
    return path


def corpus_tokenizer(corpus: str | os.PathLike, info: CorpusInfo) -> Path | None:
    """The tokenizer file the sidecar names (for decoding), None when it names none."""
    if info.tokenizer is None:
        return None
    return sidecar_path(corpus).parent / info.tokenizer


def corpus_eod_id(path: str | None) -> int | None:
    """The end-of-document id of the corpus at ``path`` (a ``data.sources`` path): its sidecar's,
    None for the default byte corpus, a text file or a ``.bin`` without a sidecar."""
    if path is None or Path(path).suffix.lower() != ".bin":
        return None
    info = read_info(path, f"data.sources: {path!r}")
    return None if info is None else info.eod_id
