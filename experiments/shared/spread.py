"""Summaries of repeated timings: median and range, and paired per-round ratios."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """Median, minimum and maximum of repeated measurements."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("Spread.of needs at least one value")
        return cls(statistics.median(values), min(values), max(values))

    def format(self, scale: float = 1e3, digits: int = 1) -> str:
        """``median [min-max]``, each times ``scale`` (milliseconds from seconds by default)."""
        return (
            f"{self.median * scale:.{digits}f} "
            f"[{self.low * scale:.{digits}f}-{self.high * scale:.{digits}f}]"
        )


def round_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """``numerators[r] / denominators[r]`` for each round r (the two measured side by side)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"rounds differ: {len(numerators)} against {len(denominators)}")
    return [n / d for n, d in zip(numerators, denominators, strict=True)]
