"""The run's text: how a prompt becomes tokens and tokens become text again.

Where the tokenizer is found, first that applies:

1. ``DIR/tokenizer.json`` (a ``tokenizers`` file, put there by hand), else
   ``DIR/hf/tokenizer.json`` (where ``jaxmoe convert`` keeps a Hugging Face model's
   tokenizer and generation files); the end-of-document ids are those of the
   ``generation_config.json`` beside it (``eos_token_id``, one or a list), else the
   token ``eos_token`` of the ``tokenizer_config.json`` beside it, else none. A
   converted model (``DIR/hf/`` exists) without a tokenizer is refused: its ids are
   not bytes;
2. the run's corpus (the first of ``data.sources``), a ``.bin`` made by ``jaxmoe data``:
   the tokenizer its sidecar names, its ``eod_id``;
3. otherwise (the default corpus, a text file) the model reads bytes: a token is a byte
   of the UTF-8 text, and there is no end-of-document token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxmoe.config import Config, ConfigError
from jaxmoe.data.corpus import CorpusInfo, sidecar_path

TOKENIZER_FILE = "tokenizer.json"
HF_DIR = "hf"  # where jaxmoe convert keeps the source's config.json and tokenizer files
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
BYTES = 256


@dataclass(frozen=True)
class TextCodec:
    """Prompt text to ids and ids to text; ``stop_ids``: the end-of-document ids."""

    tokenizer: Any  # a tokenizers.Tokenizer, or None for bytes
    stop_ids: tuple[int, ...]
    source: str  # where the tokenizer came from, for messages

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < BYTES).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _read_json(path: Path, where: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: cannot read {path.name} ({error})") from None


def _load_tokenizer(path: Path, where: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own Exception for a bad file
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{where}: {path} is not a tokenizer ({reason})") from None


def _hf_stop_ids(directory: Path, tokenizer: Any, where: str) -> tuple[int, ...]:
    """The end-of-document ids of the Hugging Face files in ``directory``."""
    generation = directory / GENERATION_CONFIG
    if generation.is_file():
        eos = _read_json(generation, where).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
    tokenizer_config = directory / TOKENIZER_CONFIG
    if tokenizer_config.is_file():
        eos = _read_json(tokenizer_config, where).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and (eos_id := tokenizer.token_to_id(eos)) is not None:
            return (eos_id,)
    return ()


def run_codec(run_dir: str | Path, config: Config) -> TextCodec:
    """The tokenizer of the run in ``run_dir`` (module docstring); ConfigError when its
    corpus's tokenizer cannot be found."""
    run_dir = Path(run_dir)
    where = f"--checkpoint {run_dir}"
    own = run_dir / TOKENIZER_FILE
    for directory in (run_dir, run_dir / HF_DIR):
        if (directory / TOKENIZER_FILE).is_file():
            file = directory / TOKENIZER_FILE
            tokenizer = _load_tokenizer(file, where)
            return TextCodec(tokenizer, _hf_stop_ids(directory, tokenizer, where), str(file))
    if (run_dir / HF_DIR).is_dir():
        raise ConfigError(
            f"{where}: a converted model without {HF_DIR}/{TOKENIZER_FILE}: copy the "
            f"model's {TOKENIZER_FILE} to {own}"
        )
    path = config.data.first_path
    if path is None or Path(path).suffix.lower() != ".bin":
        return TextCodec(None, (), "bytes")
    sidecar = sidecar_path(path)
    fix = f"copy the corpus's tokenizer to {own}"
    if not sidecar.is_file():
        raise ConfigError(
            f"{where}: the run's corpus {path} has no sidecar {sidecar.name} here to name "
            f"its tokenizer: {fix}"
        )
    try:
        info = CorpusInfo.from_json(_read_json(sidecar, where))
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{where}: {sidecar} is not a valid sidecar ({error})") from None
    if info.tokenizer is None:
        raise ConfigError(f"{where}: the run's corpus {path} names no tokenizer: {fix}")
    tokenizer_file = sidecar.parent / info.tokenizer
    if not tokenizer_file.is_file():
        raise ConfigError(f"{where}: the corpus's tokenizer {tokenizer_file} is missing: {fix}")
    stops = () if info.eod_id is None else (info.eod_id,)
    return TextCodec(_load_tokenizer(tokenizer_file, where), stops, str(tokenizer_file))
