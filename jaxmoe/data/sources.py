"""Documents read from the input files of ``jaxmoe data``, one string each.

- ``.txt``: the whole file is one document; with a separator (``--txt-separator``),
  the file is split at each occurrence of it and every piece, stripped of the
  whitespace around it, is a document. Read as UTF-8, in blocks.
- ``.jsonl`` and ``.json``: JSON lines, one object per line; the document is its text
  field (``--text-field``, default ``text``). Blank lines are skipped.
- ``.parquet``: the document is the text column's value in each row (needs pyarrow:
  ``pip install 'jaxmoe[parquet]'``); read in batches of rows.

Empty documents (and null values) are skipped. A directory stands for the ``.txt``,
``.jsonl`` and ``.parquet`` files under it, in sorted order (``.json`` files are read
only when named: in a directory they are more often something else, a corpus's sidecar
or a tokenizer). Every problem is a one-line ConfigError naming
the file (and the line) and the fix.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from jaxmoe.config import ConfigError

KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
IN_DIRECTORIES = (".txt", ".jsonl", ".parquet")
_KNOWN = ".txt, .jsonl, .json (JSON lines) or .parquet"
BLOCK_BYTES = 1 << 20
PARQUET_ROWS = 1024

Progress = Callable[[int], None]  # told how many more input bytes were read


def _no_progress(_: int) -> None:
    pass


def expand_inputs(inputs: Sequence[str]) -> list[Path]:
    """The input files: each file given, each directory's .txt, .jsonl and .parquet files."""
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IN_DIRECTORIES
            )
            if not found:
                raise ConfigError(
                    f"--input {name}: a directory without .txt, .jsonl or .parquet files"
                )
            files += found
        elif not path.exists():
            raise ConfigError(f"--input {name}: no such file")
        elif path.suffix.lower() not in KINDS:
            raise ConfigError(f"--input {name}: unknown kind of file; give {_KNOWN} files")
        else:
            files.append(path)
    return files


def _pyarrow_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"--input {path}: reading Parquet needs pyarrow: pip install 'jaxmoe[parquet]'"
        ) from None
    return pq


def _parquet_file(path: Path, field: str):
    import pyarrow as pa

    pq = _pyarrow_parquet(path)
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(f"--input {path}: not a readable Parquet file ({reason})") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise ConfigError(
            f"--input {path}: no column {field!r}; name the text column with --text-field "
            f"(columns: {', '.join(schema.names)})"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(
            f"--input {path}: column {field!r} holds {kind}, not text; "
            "name the text column with --text-field"
        )
    return parquet


def _json_text(path: Path, number: int, line: bytes, field: str) -> str | None:
    where = f"--input {path} line {number}"
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as error:
        reason = str(error).splitlines()[0]
        raise ConfigError(f"{where}: not JSON ({reason}); give one JSON object per line") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a {type(record).__name__}, not a JSON object per line")
    if field not in record:
        raise ConfigError(
            f"{where}: no {field!r} field; name the text field with --text-field "
            f"(fields: {', '.join(map(str, record))})"
        )
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"{where}: field {field!r} is a {type(text).__name__}, not text")
    return text


def check_input(path: Path, field: str) -> None:
    """Refuse a file whose first record cannot give a document, before any long work."""
    kind = KINDS[path.suffix.lower()]
    try:
        if kind == "parquet":
            _parquet_file(path, field)
        elif kind == "jsonl":
            with path.open("rb") as lines:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        _json_text(path, number, line, field)
                        break
        else:
            with path.open("rb"):
                pass
    except OSError as error:
        raise ConfigError(f"--input {path}: cannot read it ({error.strerror or error})") from None


def _split(pending: str, separator: str, scanned: int) -> tuple[list[str], str]:
    """The documents complete in ``pending`` and what is left; its first ``scanned``
    characters are known to hold no separator."""
    found, head = [], 0
    search = max(0, scanned - len(separator) + 1)
    while (at := pending.find(separator, search)) >= 0:
        found.append(pending[head:at].strip())
        head = search = at + len(separator)
    return found, pending[head:]


def _text_documents(path: Path, separator: str | None, progress: Progress) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    chunks: list[str] = []  # the whole file (no separator)
    pending = ""  # the text after the last separator
    read = 0  # bytes decoded before the current block
    try:
        with path.open("rb") as file:
            while block := file.read(BLOCK_BYTES):
                progress(len(block))
                text = decoder.decode(block)
                read += len(block)
                if separator is None:
                    chunks.append(text)
                    continue
                scanned = len(pending)
                documents, pending = _split(pending + text, separator, scanned)
                yield from documents
            rest = decoder.decode(b"", final=True)
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"--input {path}: not UTF-8 text (near byte {read + error.start}); convert it to UTF-8"
        ) from None
    if separator is None:
        yield "".join([*chunks, rest])
    else:
        yield (pending + rest).strip()


def _jsonl_documents(path: Path, field: str, progress: Progress) -> Iterator[str | None]:
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            progress(len(line))
            if line.strip():
                yield _json_text(path, number, line, field)


def _parquet_documents(path: Path, field: str, progress: Progress) -> Iterator[str | None]:
    parquet = _parquet_file(path, field)
    rows, size = max(parquet.metadata.num_rows, 1), path.stat().st_size
    done = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
        yield from batch.column(0).to_pylist()
        share = size * (done + batch.num_rows) // rows - size * done // rows
        done += batch.num_rows
        progress(share)


def documents(
    path: Path,
    field: str = "text",
    separator: str | None = None,
    progress: Progress = _no_progress,
) -> Iterator[str]:
    """The non-empty documents of one input file, in order."""
    kind = KINDS[path.suffix.lower()]
    if kind == "parquet":
        texts = _parquet_documents(path, field, progress)
    elif kind == "jsonl":
        texts = _jsonl_documents(path, field, progress)
    else:
        texts = _text_documents(path, separator, progress)
    try:
        yield from (text for text in texts if text)
    except OSError as error:
        raise ConfigError(f"--input {path}: cannot read it ({error.strerror or error})") from None
