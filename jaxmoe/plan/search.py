"""The order in which the planner estimates mappings: least lower bound first, until the
best ones are known (no JAX here).

Each candidate starts with a lower bound of its figure (a step time). Taking the
candidate of least bound, the search advances it: a tighter bound (it goes back with it),
or its figure (it is estimated; the figure counts unless it is left out, e.g. over
memory), or nothing (it is dropped). Advancing a candidate may also release others, each
with its bound: candidates that only count where this one does not (the planner's
recomputations, :mod:`jaxmoe.plan.planner`). Once ``wanted`` figures count and the least bound
left is no less than the ``wanted``-th least figure, no candidate left can be among the
``wanted`` least: the search stops, and those are exactly the ``wanted`` least figures
of all candidates, as long as every bound is one. With a ``deadline``, the search also
stops when the clock passes it: the figures found are then the least of those estimated,
not proven the least of all (:attr:`SearchEnd.complete`).

With a ``gap`` (a fraction, as a MIP solver's relative gap) the search stops once the least
bound left is no less than ``1 - gap`` times the ``wanted``-th least figure: no candidate
left is more than ``gap`` below it, so the ``wanted``-th least of all is at least ``1 -
gap`` times the one found. Where figures lie close together, that is far fewer candidates
advanced than the exact search needs.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Advance:
    """What advancing a candidate gave: a tighter ``bound`` (and the candidate to keep,
    ``item``), or its ``figure`` once estimated (None where it does not count), or neither
    (dropped); and the candidates it ``releases``, ``(bound, item)`` each, to the search."""

    bound: float | None = None
    item: Any = None
    estimated: bool = False
    figure: float | None = None
    releases: tuple[tuple[float, Any], ...] = ()


@dataclass(frozen=True)
class SearchEnd:
    """Where the search stopped: the candidates left, least bound first, and whether the
    ``wanted`` least figures are proven (False: the deadline passed first)."""

    left: list[tuple[float, Any]]
    complete: bool


def best_first(
    start: Iterable[tuple[float, Any]],
    advance: Callable[[Any], Advance],
    wanted: int,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    *,
    width: int = 1,
    prepare: Callable[[list[Any]], None] | None = None,
    gap: float = 0.0,
) -> SearchEnd:
    """Advance the candidates ``(bound, item)`` of ``start`` least bound first (module
    docstring), until the ``wanted`` least figures are known or ``clock()`` passes
    ``deadline``.

    ``width``: how many candidates are taken at once, each of the least bounds left that
    the figures found so far do not rule out; ``prepare`` is given them together before
    each is advanced (to do their work side by side). A wider search may advance a
    candidate that a narrower one would have ruled out by a figure found meanwhile, never
    one fewer: the figures it proves are the same. ``gap``: how far below the figures found
    a candidate left may be (module docstring; 0: none, exactly the least)."""
    if wanted < 1:
        raise ValueError(f"wanted={wanted}: the search needs at least one figure")
    if width < 1:
        raise ValueError(f"width={width}: advance at least one candidate at a time")
    if not 0.0 <= gap < 1.0:
        raise ValueError(f"gap={gap}: give a fraction in [0, 1)")
    tie = itertools.count()
    heap = [(bound, next(tie), item) for bound, item in start]
    heapq.heapify(heap)
    figures: list[float] = []
    complete = True

    def ruled_out(bound: float) -> bool:
        return len(figures) >= wanted and bound >= (1.0 - gap) * figures[wanted - 1]

    while heap and not ruled_out(heap[0][0]):
        if deadline is not None and clock() >= deadline:
            complete = False
            break
        taken = [heapq.heappop(heap)]
        while heap and len(taken) < width and not ruled_out(heap[0][0]):
            taken.append(heapq.heappop(heap))
        if prepare is not None:
            prepare([item for _, _, item in taken])
        for bound, _, item in taken:
            step = advance(item)
            if step.bound is not None:
                heapq.heappush(heap, (max(bound, step.bound), next(tie), step.item))
            elif step.estimated and step.figure is not None:
                bisect.insort(figures, step.figure)
            for released in step.releases:
                heapq.heappush(heap, (released[0], next(tie), released[1]))
    return SearchEnd([(bound, item) for bound, _, item in sorted(heap)], complete)
