"""``jaxmoe data``'s work: a tokenizer, and the corpus written with it.

The tokenizer is a Hugging Face ``tokenizers`` file (``tokenizer.json``: a converted
model's, or one trained here on the inputs as a byte-level BPE with the
end-of-document token as its special token). Documents are encoded in batches
without the tokenizer's own special tokens (no BOS), each followed by the
end-of-document id, and appended to ``NAME.bin`` as they come, so that no more than
one batch is held in memory. ``NAME.bin``, its sidecar and the tokenizer's copy
replace any earlier ones only once the whole corpus is written
(:mod:`jaxmoe.data.corpus` describes them).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxmoe.config import ConfigError
from jaxmoe.data import sources
from jaxmoe.data.corpus import (
    DTYPES,
    CorpusInfo,
    dtype_for,
    sidecar_path,
    tokenizer_path,
    write_info,
)

BATCH_CHARS = 1 << 20  # encode documents in batches of about this many characters
BATCH_DOCUMENTS = 1024
BYTE_ALPHABET = 256


@dataclass(frozen=True)
class CorpusRequest:
    """What ``jaxmoe data`` was asked for (its flags)."""

    inputs: Sequence[str]
    out: str
    tokenizer: str | None = None  # a tokenizer.json, or a directory holding one
    train_tokenizer: int | None = None  # or: train a byte-level BPE of this many tokens
    text_field: str = "text"
    txt_separator: str | None = None
    eod_token: str = "<|endoftext|>"
    overwrite: bool = False
    progress: bool = True


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("jaxmoe data needs tokenizers: pip install tokenizers") from None
    return tokenizers


def tokenizer_file(name: str) -> Path:
    """The ``tokenizer.json`` that ``--tokenizer NAME`` means (a file, or a directory's)."""
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"--tokenizer {name}: a directory without tokenizer.json")
    elif not path.is_file():
        raise ConfigError(
            f"--tokenizer {name}: no such file; give a tokenizer.json (or a directory "
            "holding one), or --train-tokenizer VOCAB_SIZE"
        )
    return path


def load_tokenizer(name: str):
    """The ``tokenizers.Tokenizer`` of ``--tokenizer NAME``; ConfigError if it is not one."""
    path = tokenizer_file(name)
    tokenizers = _tokenizers()
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises plain Exceptions for a malformed file
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"--tokenizer {name}: not a tokenizers file ({reason})") from None


def vocab_size(tokenizer) -> int:
    """One more than the largest id the tokenizer can produce (added tokens included)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def eod_id(tokenizer, token: str) -> int:
    """The id of the end-of-document token; ConfigError naming the candidates if absent."""
    found = tokenizer.token_to_id(token)
    if found is None:
        special = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
        choices = f"one of its special tokens: {', '.join(special)}" if special else "a token of it"
        raise ConfigError(
            f"--eod-token {token!r}: not in the tokenizer's vocabulary; give {choices}"
        )
    return found


def _all_documents(
    files: Sequence[Path], request: CorpusRequest, progress: Callable[[int], None]
) -> Iterator[str]:
    for path in files:
        yield from sources.documents(path, request.text_field, request.txt_separator, progress)


def _batches(documents: Iterator[str]) -> Iterator[list[str]]:
    batch, chars = [], 0
    for document in documents:
        batch.append(document)
        chars += len(document)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCUMENTS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _bar(request: CorpusRequest, files: Sequence[Path], description: str):
    from tqdm import tqdm

    total = sum(path.stat().st_size for path in files)
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=description,
        disable=not request.progress,
        dynamic_ncols=True,
    )


def train_tokenizer(files: Sequence[Path], request: CorpusRequest):
    """A byte-level BPE of ``request.train_tokenizer`` tokens trained on the inputs, with
    the end-of-document token as its one special token (id 0)."""
    tokenizers = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=request.train_tokenizer,
        special_tokens=[request.eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _bar(request, files, "training the tokenizer") as bar:
        batches = _batches(_all_documents(files, request, bar.update))
        tokenizer.train_from_iterator(batches, trainer=trainer)
    return tokenizer


def _encode(tokenizer, batch: list[str], eod: int, dtype: str) -> np.ndarray:
    encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)
    count = sum(len(encoding.ids) for encoding in encodings) + len(encodings)
    ids = itertools.chain.from_iterable(itertools.chain(e.ids, (eod,)) for e in encodings)
    return np.fromiter(ids, dtype=np.int64, count=count).astype(dtype)


def _check_outputs(request: CorpusRequest, files: Sequence[Path]) -> list[Path]:
    out = Path(request.out)
    if out.suffix.lower() != ".bin":
        raise ConfigError(
            f"--out {request.out}: the corpus's name must end in .bin (what --data reads as ids)"
        )
    outputs = [out, sidecar_path(out), tokenizer_path(out)]
    read = [*files, *([tokenizer_file(request.tokenizer)] if request.tokenizer else [])]
    # The tokenizer may be the copy an earlier run left: the one output it may be.
    overwritten = {path.resolve() for path in outputs[:2]}
    overwritten |= {outputs[2].resolve()} if request.tokenizer is None else set()
    for path in read:
        if path.resolve() in overwritten:
            raise ConfigError(
                f"--out {request.out} would overwrite the input {path} "
                f"(it writes {', '.join(p.name for p in outputs)}): choose another --out"
            )
    existing = [path.name for path in outputs if path.exists()]
    if existing and not request.overwrite:
        raise ConfigError(
            f"--out {request.out}: {', '.join(existing)} already "
            f"{'exists' if len(existing) == 1 else 'exist'}; "
            "give --overwrite to replace the corpus"
        )
    return outputs


def _make_writable_folder(flag_value: str, folder: Path) -> None:
    """``folder`` made if need be, and written to once; ConfigError naming ``--out`` if
    that cannot be done."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = "a file" if folder.is_file() else (error.strerror or str(error)).lower()
        raise ConfigError(
            f"--out {flag_value}: cannot write in {folder} ({reason}): choose a folder you "
            "can write"
        ) from None


def make_corpus(request: CorpusRequest) -> CorpusInfo:
    """Check everything, then tokenize the inputs into ``request.out`` and its sidecar."""
    files = sources.expand_inputs(request.inputs)
    for path in files:
        sources.check_input(path, request.text_field)
    if request.txt_separator == "":
        raise ConfigError("--txt-separator '': give a non-empty separator, or leave it out")
    if not request.eod_token:
        raise ConfigError(
            "--eod-token '': the end-of-document token needs a text of its own: give one "
            "(such as <|endoftext|>, the default), or leave the flag out"
        )
    if request.train_tokenizer is not None and request.train_tokenizer < BYTE_ALPHABET + 1:
        raise ConfigError(
            f"--train-tokenizer {request.train_tokenizer}: at least {BYTE_ALPHABET + 1} "
            "(the 256 byte tokens and --eod-token)"
        )
    out, _, tokenizer_out = _check_outputs(request, files)
    if request.tokenizer is not None:
        tokenizer = load_tokenizer(request.tokenizer)
        eod = eod_id(tokenizer, request.eod_token)
    _make_writable_folder(request.out, out.parent)
    if request.train_tokenizer is not None:
        tokenizer = train_tokenizer(files, request)
        eod = eod_id(tokenizer, request.eod_token)
        trained = vocab_size(tokenizer)
        if trained < request.train_tokenizer:
            print(f"the inputs gave {trained} of the {request.train_tokenizer} tokens asked for")

    size = vocab_size(tokenizer)
    dtype = dtype_for(size)
    documents = tokens = 0
    partial_bin = out.with_name(out.name + ".partial")
    partial_tokenizer = tokenizer_out.with_name(tokenizer_out.name + ".partial")
    try:
        with ExitStack() as stack:
            bar = stack.enter_context(_bar(request, files, "tokenizing"))
            written = stack.enter_context(partial_bin.open("wb"))
            for batch in _batches(_all_documents(files, request, bar.update)):
                ids = _encode(tokenizer, batch, eod, DTYPES[dtype])
                ids.tofile(written)
                documents += len(batch)
                tokens += len(ids)
                bar.set_postfix(documents=documents, tokens=tokens, refresh=False)
        if not documents:
            raise ConfigError(f"--input: no document in {len(files)} file(s): all are empty")
        if request.tokenizer is not None:
            shutil.copyfile(tokenizer_file(request.tokenizer), partial_tokenizer)
        else:
            tokenizer.save(str(partial_tokenizer))
        os.replace(partial_tokenizer, tokenizer_out)
        info = CorpusInfo(
            dtype=dtype,
            vocab_size=size,
            eod_id=eod,
            eod_token=request.eod_token,
            tokenizer=tokenizer_out.name,
            documents=documents,
            tokens=tokens,
        )
        # The sidecar first: a corpus interrupted here is refused (its size disagrees),
        # never read with an earlier corpus's description.
        write_info(out, info)
        os.replace(partial_bin, out)
    finally:
        partial_bin.unlink(missing_ok=True)
        partial_tokenizer.unlink(missing_ok=True)
    return info
