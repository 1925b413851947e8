"""Measured collective costs: piecewise-linear curves of seconds against message size.

A sweep times each collective kind over each group size at a series of
operand sizes (``jaxmoe link-curves`` does it on any cluster, the emulated
one included). :meth:`PiecewiseLinear.fit` turns the samples
into a curve: the median at each size, made non-decreasing, interpolated
linearly between sizes and extrapolated with the last segment's slope (below
the smallest size, the smallest size's time: latency dominates there). A
:class:`CollectiveCurves` file holds one curve per (kind, group size);
:class:`~scheduling.costs.cost_model.CostModel` uses it for the collectives it covers.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduling.program.capture import COLLECTIVES


@dataclass(frozen=True)
class PiecewiseLinear:
    sizes: tuple[float, ...]  # operand bytes, strictly increasing
    seconds: tuple[float, ...]  # non-decreasing

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError("PiecewiseLinear needs as many sizes as times, at least one")
        if not all(math.isfinite(v) and v >= 0 for v in (*self.sizes, *self.seconds)):
            raise ValueError("PiecewiseLinear sizes and times must be finite numbers >= 0")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ValueError("PiecewiseLinear.sizes must be strictly increasing")
        if any(b < a for a, b in zip(self.seconds, self.seconds[1:], strict=False)):
            raise ValueError("PiecewiseLinear.seconds must be non-decreasing")

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]]) -> PiecewiseLinear:
        """From ``(operand bytes, seconds)`` samples, several per size allowed."""
        by_size: dict[float, list[float]] = defaultdict(list)
        for size, seconds in samples:
            by_size[float(size)].append(float(seconds))
        sizes = sorted(by_size)
        medians, floor = [], 0.0
        for size in sizes:
            floor = max(floor, statistics.median(by_size[size]))  # more bytes never cost less
            medians.append(floor)
        return cls(tuple(sizes), tuple(medians))

    def __call__(self, size: float) -> float:
        if len(self.sizes) == 1 or size <= self.sizes[0]:
            return self.seconds[0]
        # The segment holding ``size``, or the last one beyond the largest size.
        right = min(bisect.bisect_right(self.sizes, size), len(self.sizes) - 1)
        left = right - 1
        slope = (self.seconds[right] - self.seconds[left]) / (self.sizes[right] - self.sizes[left])
        return self.seconds[left] + slope * (size - self.sizes[left])


@dataclass
class CollectiveCurves:
    """One curve per (collective kind, group size), with where they were measured."""

    source: str
    curves: dict[tuple[str, int], PiecewiseLinear] = field(default_factory=dict)

    def seconds(self, kind: str, group_size: int, operand_bytes: float) -> float | None:
        curve = self.curves.get((kind, group_size))
        return None if curve is None else curve(operand_bytes)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "curves": [
                {
                    "kind": kind,
                    "group_size": group,
                    "bytes": list(c.sizes),
                    "seconds": list(c.seconds),
                }
                for (kind, group), c in sorted(self.curves.items())
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> CollectiveCurves:
        """Curves from :meth:`to_json`'s structure; ValueError names what is wrong, and where."""
        if not isinstance(data, dict) or not isinstance(data.get("curves"), list):
            raise ValueError('expected an object {"source": ..., "curves": [...]}')
        source = data.get("source", "")
        if not isinstance(source, str):
            raise ValueError(f"source must be a string, not {source!r}")
        if not data["curves"]:
            raise ValueError("curves is empty: it must hold at least one curve")
        curves: dict[tuple[str, int], PiecewiseLinear] = {}
        for index, entry in enumerate(data["curves"]):
            key, curve = _curve_from_json(entry, f"curves[{index}]")
            if key in curves:
                raise ValueError(f"curves[{index}]: a second curve for {key[0]} over {key[1]}")
            curves[key] = curve
        return cls(source, curves)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CollectiveCurves:
        """Read a file written by :meth:`save`.

        OSError if it cannot be read; ValueError if it is not JSON or not a curve set
        that the cost model can use.
        """
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
            ) from None
        return cls.from_json(data)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _curve_from_json(entry: Any, where: str) -> tuple[tuple[str, int], PiecewiseLinear]:
    """One ``{"kind", "group_size", "bytes", "seconds"}`` entry, checked."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with kind, group_size, bytes and seconds")
    missing = [key for key in ("kind", "group_size", "bytes", "seconds") if key not in entry]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    kind, group = entry["kind"], entry["group_size"]
    if not (isinstance(kind, str) and kind in COLLECTIVES):
        raise ValueError(
            f"{where}.kind={kind!r} is not a collective: use one of "
            f"{', '.join(sorted(COLLECTIVES))}"
        )
    # A group of one moves nothing, so the cost model never asks for its curve.
    if not (isinstance(group, int) and not isinstance(group, bool) and group >= 2):
        raise ValueError(f"{where}.group_size={group!r}: must be an integer >= 2")
    for name in ("bytes", "seconds"):
        values = entry[name]
        if not (isinstance(values, list) and values and all(_is_number(v) for v in values)):
            raise ValueError(f"{where}.{name} must be a non-empty list of numbers")
    try:
        curve = PiecewiseLinear(tuple(entry["bytes"]), tuple(entry["seconds"]))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return (kind, group), curve
