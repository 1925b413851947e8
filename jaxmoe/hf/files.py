"""A Hugging Face model directory: its ``config.json``, its safetensors shards, and the
files beside them (the tokenizer), read and written without JAX.

Reading takes the shards the index (``model.safetensors.index.json``) names, else
``model.safetensors``, else every ``*.safetensors`` file; the headers are read first
(names, shapes and dtypes, no data), so every tensor is checked before the first one is
loaded. Writing puts the tensors, in order, into shards of at most ``max_shard_bytes``
(``model.safetensors`` when one is enough, else ``model-00001-of-0000N.safetensors``
and the index), as transformers names them.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxmoe.config import ConfigError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# The files beside the weights that a converted run keeps (in RUN/hf/) and writes back.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# Weight dtypes jaxmoe reads (widened to its float32 parameters, exactly) and writes.
READ_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
# Block-scaled FP8 weights (jaxmoe/hf/block_fp8.py), read with their scales.
FP8_STORED = "F8_E4M3"
# Dtypes safetensors' numpy reader cannot name (numpy has no float8): read as raw bytes.
RAW_DTYPES = {FP8_STORED: ml_dtypes.float8_e4m3fn}
WRITE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def read_config(directory: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory (one-line errors)."""
    path = directory / CONFIG
    if not directory.is_dir():
        raise ConfigError(f"--from-hf {directory}: not a directory")
    if not path.is_file():
        raise ConfigError(f"--from-hf {directory}: has no {CONFIG}")
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: cannot be read as JSON ({error})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return values


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


def _shard_files(directory: Path) -> list[Path]:
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"{index}: not a safetensors index ({error!r})") from None
        for name in files:
            if not (directory / name).is_file():
                raise ConfigError(f"{index} names {name}, which is not in {directory}")
        return [directory / name for name in files]
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"--from-hf {directory}: holds no *.safetensors weights (PyTorch .bin files are "
            "not read: save the model with safetensors)"
        )
    return files


def read_headers(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of the directory's shards: its file, shape and dtype (no data read)."""
    from safetensors import safe_open

    tensors: dict[str, TensorInfo] = {}
    for file in _shard_files(directory):
        try:
            with safe_open(file, framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 (a handle, not a dict)
                    view = handle.get_slice(name)
                    if name in tensors:
                        raise ConfigError(
                            f"{file}: {name} is also in {tensors[name].file.name}: "
                            "a tensor must be in one shard"
                        )
                    tensors[name] = TensorInfo(file, tuple(view.get_shape()), view.get_dtype())
        except ConfigError:
            raise
        except Exception as error:  # safetensors' own errors: a truncated or foreign file
            raise ConfigError(f"{file}: not a readable safetensors file ({error})") from None
    return tensors


def read_tensors(files: dict[Path, list[str]]) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` for the named tensors, one shard after the other, one tensor at a
    time (the caller keeps what it needs)."""
    from safetensors import safe_open

    for file, names in files.items():
        raw = None  # the file's header, read once, when a tensor needs it
        with safe_open(file, framework="numpy") as handle:
            for name in names:
                dtype = handle.get_slice(name).get_dtype()
                if dtype in RAW_DTYPES:
                    raw = raw or _RawFile(file)
                    yield name, raw.read(name, RAW_DTYPES[dtype])
                else:
                    yield name, handle.get_tensor(name)


class _RawFile:
    """A safetensors file's tensors from their bytes: the file is an 8-byte little-endian
    header length, the JSON header (each tensor's shape and byte range), then the data."""

    def __init__(self, file: Path):
        self.file = file
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            self.header = json.loads(handle.read(length))
        self.data_start = 8 + length

    def read(self, name: str, dtype: Any) -> np.ndarray:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        with open(self.file, "rb") as handle:
            handle.seek(self.data_start + begin)
            data = handle.read(end - begin)
        return np.frombuffer(data, dtype).reshape(entry["shape"])


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped into shards of at most ``max_shard_bytes`` (a larger
    tensor alone in its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes:
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_shard(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def write_index(directory: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_config(directory: Path, values: dict[str, Any]) -> None:
    (directory / CONFIG).write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def model_files(directory: Path) -> list[Path]:
    """What writing a model replaces in ``directory``: weights, index and config."""
    if not directory.is_dir():
        return []
    found = [*directory.glob("*.safetensors"), directory / INDEX, directory / CONFIG]
    return [path for path in found if path.exists()]


def copy_side_files(source: Path, target: Path) -> list[str]:
    """Copy the tokenizer and generation files of :data:`SIDE_FILES` that ``source`` has."""
    copied = []
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``64KB`` or a number of bytes (decimal units, as transformers)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?B)?\s*", text.upper())
    size = int(float(match.group(1)) * units[match.group(2) or ""]) if match else 0
    if size <= 0:
        raise ConfigError(f"--max-shard-size {text}: give a size such as 5GB, 500MB or 64KB")
    return size
