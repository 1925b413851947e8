"""``jaxmoe data``: text, JSON lines or Parquet files tokenized into a corpus for ``--data``.

    jaxmoe data --input docs/ more.jsonl --out corpus/web.bin --tokenizer tokenizer.json
    jaxmoe data --input books.parquet --out corpus/books.bin --train-tokenizer 8192

writes ``web.bin`` (the ids, uint16 or uint32), ``web.json`` (its sidecar) and
``web.tokenizer.json`` (the tokenizer) (:mod:`jaxmoe.data`). Every input, the tokenizer
and the output names are checked before the first document is read: a bad one is one
line and exit status 2.
"""

from __future__ import annotations

import argparse

from jaxmoe.config import Config

_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\\\": "\\"}


def unescape(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` in a separator typed on the command line."""
    out, i = [], 0
    while i < len(text):
        pair = text[i : i + 2]
        if pair in _ESCAPES:
            out.append(_ESCAPES[pair])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def add_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--input",
        nargs="+",
        action="extend",
        required=True,
        metavar="FILE",
        help=".txt, .jsonl/.json (JSON lines) or .parquet files, or directories of them",
    )
    command.add_argument("--out", required=True, metavar="CORPUS.bin", help="the corpus to write")
    tokenizer = command.add_mutually_exclusive_group(required=True)
    tokenizer.add_argument(
        "--tokenizer", metavar="FILE", help="a tokenizers tokenizer.json (or its directory)"
    )
    tokenizer.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB_SIZE",
        help="train a byte-level BPE of VOCAB_SIZE tokens on the inputs",
    )
    command.add_argument(
        "--text-field", default="text", help="the text field (JSON lines) or column (Parquet)"
    )
    command.add_argument(
        "--txt-separator",
        metavar="TEXT",
        help="split .txt files into documents at TEXT ('\\n\\n', '<|endoftext|>'); "
        "default: a file is one document",
    )
    command.add_argument(
        "--eod-token",
        default="<|endoftext|>",
        help="the end-of-document token appended to every document",
    )
    command.add_argument("--overwrite", action="store_true", help="replace an existing corpus")
    command.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(config: Config | None, args: argparse.Namespace) -> int:
    """Make the corpus (``config`` is unused: ``jaxmoe data`` has no run configuration)."""
    from jaxmoe.data.build import CorpusRequest, make_corpus

    info = make_corpus(
        CorpusRequest(
            inputs=args.input,
            out=args.out,
            tokenizer=args.tokenizer,
            train_tokenizer=args.train_tokenizer,
            text_field=args.text_field,
            txt_separator=None if args.txt_separator is None else unescape(args.txt_separator),
            eod_token=args.eod_token,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    )
    print(
        f"wrote {args.out}: {info.documents} documents, {info.tokens} tokens as {info.dtype} "
        f"(vocabulary {info.vocab_size}, {info.eod_token} = {info.eod_id}), its sidecar and "
        f"tokenizer {info.tokenizer}; train on it with --data {args.out} "
        f"--model.vocab_size {info.vocab_size} (or more)"
    )
    return 0
