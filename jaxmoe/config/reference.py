"""The configuration reference: one markdown table per section, read from the code.

A row is a field of a section's dataclass (the class :class:`Config` holds, wherever it
is defined): its flag, its default, the values it takes and its meaning, which is the
``#`` comment above the field (or after it, on its line) in the class's source. A field
without one is an error. The README holds the tables between two marker lines:

    python -m jaxmoe.config.reference --write README.md   # rewrite them
    python -m jaxmoe.config.reference --check README.md   # exit 1 if they are stale

No JAX here, like the rest of the package.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

import scheduling.names
from jaxmoe.config import choices
from jaxmoe.config.config import Config
from jaxmoe.config.data import DataSource
from jaxmoe.config.moe import DROPLESS_DISPATCHES
from jaxmoe.config.schedule import RUN_FIELDS
from jaxmoe.config.train import ZERO_STAGES

BEGIN = "<!-- reference:config begin -->"
END = "<!-- reference:config end -->"
COMMAND = "python -m jaxmoe.config.reference --write README.md"

# The fields that take one of a fixed set of names, and the set; the table lists them in
# place of the field's type. A key that names no field is reported by the tests.
CHOICES: dict[str, tuple[Any, ...]] = {
    "model.dtype": choices.DTYPES,
    "model.fp8": choices.FP8_RECIPES,
    "model.recompute": choices.RECOMPUTE,
    "model.norm": choices.NORMS,
    "model.position": choices.POSITIONS,
    "model.rope_scaling": choices.ROPE_SCALINGS,
    "model.activation": choices.ACTIVATIONS,
    "moe.score_function": choices.SCORE_FUNCTIONS,
    "moe.dispatcher": choices.DISPATCHERS,
    "moe.dropless_dispatch": DROPLESS_DISPATCHES,
    "train.on_nonfinite": choices.ON_NONFINITE,
    "train.grad_sync": choices.GRAD_SYNC_CHOICES,
    "train.zero": ZERO_STAGES,
    "schedule.name": scheduling.names.POLICIES,
    "schedule.profile": scheduling.names.PROFILES,
    "schedule.transport": scheduling.names.TRANSPORTS,
    "schedule.op_costs": scheduling.names.OP_COSTS,
    "schedule.xla_pin": scheduling.names.XLA_PINS,
}

# How a field's annotation reads on the command line (anything else is shown as written).
_TYPE_WORDS = {
    "int": "integer",
    "float": "number",
    "str": "text",
    "bool": "true or false",
    "None": "none",
    "tuple[DataSource, ...]": "`FILE[:WEIGHT]` ...",
}
# Comments that speak to a tool, not to a reader.
_PRAGMAS = ("fmt:", "noqa", "type:", "pragma")


class ReferenceTableError(ValueError):
    """A field the reference cannot describe (it has no comment), or no block to rewrite."""


def sections() -> dict[str, type]:
    """Each section's name and the dataclass that holds it, in :class:`Config`'s order
    (the classes the command line builds, as :mod:`jaxmoe.cli.parser` finds them)."""
    defaults = Config()
    return {item.name: type(getattr(defaults, item.name)) for item in dataclasses.fields(Config)}


def field_comments(cls: type) -> dict[str, str]:
    """Each field of the dataclass ``cls`` with the text of its comment: the ``#`` lines
    right above it, then the comment at the end of its line, joined into one paragraph
    ('' for a field that has none)."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line (1-based) -> comment text
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            if not text.startswith(_PRAGMAS):
                comments[token.start[0]] = text
    (class_node,) = ast.parse(source).body
    found = {}
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].lstrip().startswith("#"):
            if line in comments:
                above.append(comments[line])
            line -= 1
        after = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        found[node.target.id] = " ".join([*reversed(above), *after])
    return {item.name: found.get(item.name, "") for item in dataclasses.fields(cls)}


def _value(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None or value == ():
        return "none"
    if isinstance(value, tuple):  # data.sources
        return " ".join(_value(item) for item in value)
    if isinstance(value, DataSource):
        return value.text
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _values(flag: str, item: dataclasses.Field) -> str:
    if flag in CHOICES:
        return ", ".join(f"`{_value(choice)}`" for choice in CHOICES[flag])
    annotation = item.type if isinstance(item.type, str) else inspect.formatannotation(item.type)
    parts = [part.strip() for part in annotation.split("|")]
    return " or ".join(_TYPE_WORDS.get(part, part) for part in parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def section_table(section: str, cls: type) -> str:
    """The markdown table of one section: a row per setting, in the class's order, with
    the default a configuration starts from (the schedule's run-filled fields left out)."""
    defaults = getattr(Config(), section, None) or cls()
    settings = [
        item
        for item in dataclasses.fields(cls)
        if not (section == "schedule" and item.name in RUN_FIELDS)
    ]
    comments = {
        name: text
        for name, text in field_comments(cls).items()
        if name in {i.name for i in settings}
    }
    missing = [name for name, text in comments.items() if not text]
    if missing:
        where = inspect.getsourcefile(cls)
        raise ReferenceTableError(
            f"{cls.__name__} ({where}): no comment for "
            f"{', '.join(f'{section}.{name}' for name in missing)}; write one above each field"
        )
    rows = [
        f"#### `{section}`: `{cls.__name__}` (`{cls.__module__.replace('.', '/')}.py`)",
        "",
        "| flag | default | values | meaning |",
        "|---|---|---|---|",
    ]
    for item in settings:
        flag = f"{section}.{item.name}"
        shown = f"`{_value(getattr(defaults, item.name))}`"
        rows.append(
            f"| `--{flag}` | {shown} | {_values(flag, item)} | {_cell(comments[item.name])} |"
        )
    return "\n".join(rows)


def reference() -> str:
    """The README's block: every section's table, between the markers."""
    tables = [section_table(name, cls) for name, cls in sections().items()]
    note = (
        "<!-- Generated from the field comments of the configuration's dataclasses by "
        f"`{COMMAND}` (`make reference`): edit those comments, not this block. -->"
    )
    return "\n\n".join([BEGIN, note, *tables, END])


def replace_block(text: str, block: str) -> str:
    """``text`` with its block between the markers replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ReferenceTableError(f"no {BEGIN} ... {END} block to replace")
    return text[:start] + block + text[end + len(END) :]


def stale(text: str) -> str | None:
    """What is wrong with the block of ``text`` (a README), or None if it is up to date."""
    try:
        expected = replace_block(text, reference())
    except ReferenceTableError as error:
        return str(error)
    if expected != text:
        return f"the configuration reference is out of date: run `{COMMAND}`"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxmoe.config.reference",
        description="The configuration reference tables (printed without an option).",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", metavar="README", type=Path, help="rewrite the block in it")
    mode.add_argument("--check", metavar="README", type=Path, help="exit 1 if it is stale")
    args = parser.parse_args(argv)
    try:
        if args.write:
            text = args.write.read_text(encoding="utf-8")
            args.write.write_text(replace_block(text, reference()), encoding="utf-8")
        elif args.check:
            problem = stale(args.check.read_text(encoding="utf-8"))
            if problem:
                print(problem, file=sys.stderr)
                return 1
        else:
            print(reference())
    except ReferenceTableError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
