"""Measured collective costs: piecewise-linear curves of seconds against message size.

A sweep times each collective kind over each group size at a series of
operand sizes (``experiments/collective_sweep.py`` does it on any cluster,
the emulated one included). :meth:`PiecewiseLinear.fit` turns the samples
into a curve: the median at each size, made non-decreasing, interpolated
linearly between sizes and extrapolated with the last segment's slope (below
the smallest size, the smallest size's time: latency dominates there). A
:class:`CollectiveCurves` file holds one curve per (kind, group size);
:class:`~scheduling.cost.CostModel` uses it for the collectives it covers.
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class PiecewiseLinear:
    sizes: tuple[float, ...]  # operand bytes, strictly increasing
    seconds: tuple[float, ...]  # non-decreasing

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError("PiecewiseLinear needs as many sizes as times, at least one")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ValueError("PiecewiseLinear.sizes must be strictly increasing")

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
    def from_json(cls, data: dict) -> CollectiveCurves:
        curves = {
            (entry["kind"], int(entry["group_size"])): PiecewiseLinear(
                tuple(entry["bytes"]), tuple(entry["seconds"])
            )
            for entry in data["curves"]
        }
        return cls(data.get("source", ""), curves)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CollectiveCurves:
        return cls.from_json(json.loads(Path(path).read_text()))
