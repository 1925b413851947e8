"""The data section: the corpora the training text is drawn from, and their weights.

A run trains on one corpus or on a mixture of several, each with a weight: its share of
the rows of every batch. On the command line a source is ``FILE[:WEIGHT]`` (``--data
web.bin:3 code.bin:1``; a bare ``FILE`` weighs 1); in a configuration file it is a table,
``sources = [{ path = "web.bin", weight = 3 }, { path = "code.bin", weight = 1 }]``. The
key ``path`` of configurations written before mixtures (a run's ``config.json``) is read
as one source of weight 1. No files are read here (:mod:`jaxmoe.cli.inputs` does).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from jaxmoe.config.checks import (
    ConfigError,
    check_types,
    closest,
    positive_int,
    require,
)


@dataclass(frozen=True)
class DataSource:
    """One corpus of the mixture and its weight."""

    # A text file (bytes), or a .bin of token ids: with its sidecar NAME.json (written by
    # `jaxmoe data`) in the sidecar's dtype, without one uint16.
    path: str
    # Its share of the rows: weight / the sum of the sources' weights.
    weight: float = 1.0

    def __post_init__(self) -> None:
        require(
            isinstance(self.path, str) and self.path != "",
            f"data.sources: path={self.path!r}: give the corpus's file",
        )
        weight = self.weight
        require(
            isinstance(weight, int | float)
            and not isinstance(weight, bool)
            and math.isfinite(weight)
            and weight > 0,
            f"data.sources: {self.path!r} has weight {weight!r}: a weight is a finite number "
            "> 0 (a corpus of weight 0 is never read: leave it out)",
        )

    @property
    def text(self) -> str:
        """The source as the command line writes it, ``FILE:WEIGHT``."""
        return f"{self.path}:{self.weight:g}"

    @classmethod
    def parse(cls, text: str) -> DataSource:
        """``FILE`` (weight 1) or ``FILE:WEIGHT``: the last ``:`` followed by a number
        separates the weight."""
        path, colon, weight = text.rpartition(":")
        try:
            value = float(weight)
        except ValueError:  # no weight, or a colon in the file's name
            return cls(text)
        return cls(path, value) if colon and path else cls(text)


def parse_sources(texts: Sequence[str]) -> tuple[DataSource, ...]:
    """The command line's ``FILE[:WEIGHT] ...``; ``none`` alone: the default corpus."""
    if len(texts) == 1 and texts[0].lower() in ("none", "null"):
        return ()
    return tuple(DataSource.parse(text) for text in texts)


def _source(index: int, value: Any) -> DataSource:
    """Entry ``index`` of ``data.sources`` as given: a DataSource, or a table of a file."""
    if isinstance(value, DataSource):
        return value
    where = f"data.sources[{index}]"
    require(
        isinstance(value, Mapping),
        f'{where}={value!r}: a source is a table, {{ path = "FILE", weight = 1.0 }}',
    )
    known = [item.name for item in fields(DataSource)]
    for key in value:
        if key not in known:
            guess = closest(key, known)
            fix = f"did you mean {guess}?" if guess else f"a source has {', '.join(known)}"
            raise ConfigError(f"unknown field {where}.{key}: {fix}")
    require("path" in value, f"{where} has no path: give the corpus's file")
    weight = value.get("weight", 1.0)
    if isinstance(weight, int) and not isinstance(weight, bool):
        weight = float(weight)
    return DataSource(value["path"], weight)


def saved_data_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """A given or saved section's fields, ``sources`` read into :class:`DataSource`\\ s;
    ``path`` (a configuration written before mixtures) read as one source of weight 1."""
    values = dict(values)
    if "path" in values:
        require(
            "sources" not in values,
            "data.path and data.sources are both given: data.path is the old spelling of one "
            "source; keep data.sources",
        )
        path = values.pop("path")
        values["sources"] = () if path is None else ({"path": path, "weight": 1.0},)
    if "sources" in values:
        given = values["sources"]
        require(
            isinstance(given, list | tuple),
            f'data.sources={given!r}: a list of sources, [{{ path = "FILE", weight = 1.0 }}, ...]',
        )
        values["sources"] = tuple(_source(index, value) for index, value in enumerate(given))
    return values


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from."""

    # The corpora and their weights (`--data FILE[:WEIGHT] ...`; in a configuration file,
    # `sources = [{ path = "FILE", weight = 1.0 }, ...]`): each step's rows are drawn from
    # them in proportion to the weights. Each is a text file (bytes) or a .bin of token
    # ids (with its sidecar NAME.json, written by `jaxmoe data`, in the sidecar's dtype;
    # without one, uint16); the corpora of a mixture share one tokenizer. None: the
    # Python standard library sources.
    sources: tuple[DataSource, ...] = ()
    # The last this fraction of each corpus's tokens is its validation split.
    val_fraction: float = 0.05
    # Read at most this many bytes of the default corpus (None = all of it).
    max_bytes: int | None = 8_000_000
    # Keep the loss and attention inside documents: no target after an end-of-document
    # token, attention and positions restart there (needs corpora with an end-of-document
    # id: ones that `jaxmoe data` wrote).
    mask_across_documents: bool = False
    # Batches read ahead of the step by the input pipeline's threads (0: each batch is
    # read on the training thread when the step needs it).
    prefetch: int = 2

    def __post_init__(self) -> None:
        check_types("data", self)
        require(
            isinstance(self.val_fraction, float | int) and 0 < self.val_fraction < 1,
            f"data.val_fraction={self.val_fraction!r}: must be in (0, 1)",
        )
        if self.max_bytes is not None:
            positive_int("data", "max_bytes", self.max_bytes)
        require(
            isinstance(self.prefetch, int) and self.prefetch >= 0,
            f"data.prefetch={self.prefetch!r}: must be an integer >= 0",
        )
        seen: dict[str, str] = {}
        for source in self.sources:
            key = os.path.normpath(source.path)
            require(
                key not in seen,
                f"data.sources: {source.path!r} is given twice (as {seen.get(key)!r} too): "
                "give each corpus once, with the sum of its weights",
            )
            seen[key] = source.path
        require(
            not self.mask_across_documents or bool(self.sources),
            "data.mask_across_documents=True: the default byte corpus has no end-of-document "
            "token; give a corpus made by `jaxmoe data` with --data",
        )

    @property
    def first_path(self) -> str | None:
        """The first corpus's file (its sidecar names the mixture's tokenizer and
        end-of-document id), None for the default corpus."""
        return self.sources[0].path if self.sources else None
