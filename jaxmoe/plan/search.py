"""The order in which the planner estimates mappings: least first bound first, until the
best ones are known (no JAX here).

Each candidate starts with a lower bound of its figure (a step time). Taking the
candidate of least first bound, the search advances it: a tighter bound (it goes back
with it, in its place: below), or its figure (it is estimated; the figure counts unless
it is left out, e.g. over memory), or nothing (it is dropped). Advancing a candidate may
also release others, each with its bound: candidates that only count where this one does
not (the planner's recomputations, :mod:`jaxmoe.plan.planner`). Once ``wanted`` figures
count and the least bound left is no less than the ``wanted``-th least figure, no
candidate left can be among the ``wanted`` least: the search stops, and those are exactly
the ``wanted`` least figures of all candidates, as long as every bound is one. With a
``deadline``, the search also stops when the clock passes it: the figures found are then
the least of those estimated, not proven the least of all (:attr:`SearchEnd.complete`).

A candidate that goes back with a tighter bound keeps its place: it is taken again next,
unless the tighter bound is ruled out by then. The first bounds come alike (the planner's,
each from a shallow trace of a layout and arithmetic on it), the tighter ones from more
work and closer to the figures. Taken least bound first, a tighter bound would go behind
the first bounds a little under it, and the candidates of low first bound would all be
tightened before any is estimated (``small`` on 64 devices: 80 traces before the first
estimate, against 2 kept in place; ``experiments/results/plan_order.md``). Kept in place,
the candidates of least first bound are estimated first, and a deadline keeps their
figures. The pruning is by the tighter bounds all the same, so the figures proven are
the same.

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
import operator
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


def most_over_least(found: float, least_bound: float) -> float:
    """How much over the least figure of all a ``found`` one may be (a fraction), where no
    candidate left is under ``least_bound``: nothing where ``found`` is under that bound."""
    return max(0.0, found / least_bound - 1)


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
    """Advance the candidates ``(bound, item)`` of ``start`` least first bound first
    (module docstring), until the ``wanted`` least figures are known or ``clock()`` passes
    ``deadline``.

    ``width``: how many candidates are taken at once, the first in order whose bounds the
    figures found so far do not rule out; ``prepare`` is given them together before each
    is advanced (to do their work side by side). A wider search may advance a candidate
    that a narrower one would have ruled out by a figure found meanwhile, never one fewer:
    the figures it proves are the same. ``gap``: how far below the figures found
    a candidate left may be (module docstring; 0: none, exactly the least)."""
    if wanted < 1:
        raise ValueError(f"wanted={wanted}: the search needs at least one figure")
    if width < 1:
        raise ValueError(f"width={width}: advance at least one candidate at a time")
    if not 0.0 <= gap < 1.0:
        raise ValueError(f"gap={gap}: give a fraction in [0, 1)")
    tie = itertools.count()
    # The candidates in their order (first bound, then the order they came in), and their
    # bounds least first: a bound whose candidate was taken (its number in
    # ``taken_numbers``) leaves the second heap when it comes up.
    by_place: list[tuple[tuple[float, int], int, float, Any]] = []
    by_bound: list[tuple[float, int]] = []
    taken_numbers: set[int] = set()
    ruled: list[tuple[float, Any]] = []  # taken in order with their bound ruled out: left
    figures: list[float] = []
    complete = True

    def push(bound: float, item: Any, place: tuple[float, int] | None = None) -> None:
        number = next(tie)
        heapq.heappush(by_place, (place or (bound, number), number, bound, item))
        heapq.heappush(by_bound, (bound, number))

    def least_bound() -> float | None:
        while by_bound and by_bound[0][1] in taken_numbers:
            taken_numbers.discard(heapq.heappop(by_bound)[1])
        return by_bound[0][0] if by_bound else None

    def ruled_out(bound: float | None) -> bool:
        return (
            bound is not None
            and len(figures) >= wanted
            and bound >= (1.0 - gap) * figures[wanted - 1]
        )

    for bound, item in start:
        push(bound, item)
    while least_bound() is not None and not ruled_out(least_bound()):
        if deadline is not None and clock() >= deadline:
            complete = False
            break
        taken: list[tuple[tuple[float, int], float, Any]] = []
        while by_place and len(taken) < width and not ruled_out(least_bound()):
            place, number, bound, item = heapq.heappop(by_place)
            taken_numbers.add(number)
            if ruled_out(bound):  # the figures only come down: it stays ruled out
                ruled.append((bound, item))
            else:
                taken.append((place, bound, item))
        if prepare is not None:
            prepare([item for _, _, item in taken])
        for place, bound, item in taken:
            step = advance(item)
            if step.bound is not None:
                push(max(bound, step.bound), step.item, place)
            elif step.estimated and step.figure is not None:
                bisect.insort(figures, step.figure)
            for released in step.releases:
                push(*released)
    left = ruled + [(bound, item) for _, _, bound, item in by_place]
    return SearchEnd(sorted(left, key=operator.itemgetter(0)), complete)
