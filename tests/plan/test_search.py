"""The planner's search (jaxmoe/plan/search.py): least bound first, stopping once the best
are known; no JAX."""

from __future__ import annotations

import random

import pytest

from jaxmoe.plan.search import Advance, best_first


def _candidates(seed: int, count: int = 40) -> dict[str, tuple[float, float, float, bool]]:
    """name -> (first bound, tighter bound, figure, counts)."""
    rng = random.Random(seed)
    found = {}
    for index in range(count):
        figure = rng.uniform(1.0, 10.0)
        tighter = figure * rng.uniform(0.7, 1.0)
        first = tighter * rng.uniform(0.5, 1.0)
        found[f"m{index}"] = (first, tighter, figure, rng.random() > 0.3)
    return found


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("wanted", [1, 3])
@pytest.mark.parametrize("width", [1, 4])
def test_the_wanted_least_figures_are_exact(seed, wanted, width):
    """Also when candidates are taken several at a time (the planner's workers): each
    batch is prepared together, then advanced in order."""
    candidates = _candidates(seed)
    advanced = []
    batches = []

    def advance(item):
        name, stage = item
        advanced.append(item)
        _, tighter, figure, counts = candidates[name]
        if stage == "bound":
            return Advance(tighter, (name, "tighter"))
        return Advance(estimated=True, figure=figure if counts else None)

    end = best_first(
        ((c[0], (n, "bound")) for n, c in candidates.items()),
        advance,
        wanted,
        width=width,
        prepare=batches.append,
    )
    left = end.left
    assert end.complete
    assert [item for batch in batches for item in batch] == advanced
    assert max(len(batch) for batch in batches) == width
    estimated = {name for name, stage in advanced if stage == "tighter"}
    counted = sorted(candidates[n][2] for n in estimated if candidates[n][3])
    every = sorted(c[2] for c in candidates.values() if c[3])
    assert counted[:wanted] == every[:wanted]
    # It stopped early: not every candidate was estimated, and what is left is bounded
    # out by the wanted-th figure.
    assert len(estimated) < len(candidates)
    assert all(bound >= every[wanted - 1] for bound, _ in left)
    assert {name for _, (name, _) in left} | {n for n, _ in advanced} == set(candidates)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gap", [0.05, 0.2])
def test_a_gap_stops_once_none_left_can_be_that_much_under_the_wanted(seed, gap):
    """Figures close together (within 30%): the exact search advances most candidates;
    with a gap, fewer, and the wanted-th least of all is no more than the gap under the
    one found."""
    rng = random.Random(seed)
    candidates = {}
    for index in range(60):
        figure = rng.uniform(1.0, 1.3)
        candidates[f"m{index}"] = (figure * rng.uniform(0.85, 1.0), figure)

    def figures(names) -> list[float]:
        return sorted(candidates[n][1] for n in names)

    def search(gap: float) -> tuple[list[float], set[str]]:
        advanced = set()

        def advance(name):
            advanced.add(name)
            return Advance(estimated=True, figure=candidates[name][1])

        end = best_first(((c[0], n) for n, c in candidates.items()), advance, 3, gap=gap)
        assert end.complete
        third = figures(advanced)[2]
        assert all(bound >= (1 - gap) * third for bound, _ in end.left)
        return figures(advanced), advanced

    exact, exact_advanced = search(0.0)
    assert exact[:3] == figures(candidates)[:3]
    found, advanced = search(gap)
    assert advanced < exact_advanced  # a subset, and fewer
    # Of all candidates, the best and the third are at most the gap under those found.
    assert exact[0] >= (1 - gap) * found[0] and exact[2] >= (1 - gap) * found[2]


def test_a_gap_is_a_fraction_under_one():
    with pytest.raises(ValueError, match=r"gap=1\.0"):
        best_first([], lambda item: Advance(), 1, gap=1.0)


def test_dropped_candidates_never_count():
    def advance(item):
        return Advance() if item == "dropped" else Advance(estimated=True, figure=2.0)

    end = best_first([(1.0, "dropped"), (1.5, "kept")], advance, 1)
    assert end.left == [] and end.complete


def test_at_least_one_figure_is_wanted():
    with pytest.raises(ValueError, match="wanted=0"):
        best_first([], lambda item: Advance(), 0)


def test_a_deadline_stops_the_search_with_what_it_estimated():
    """A clock that passes the deadline after three advances: the candidates not advanced
    are left, least bound first, and the search says it is not complete."""
    ticks = iter(range(100))
    advanced = []

    def advance(item):
        advanced.append(item)
        return Advance(estimated=True, figure=10.0 + item)

    start = [(float(n), n) for n in (4, 2, 0, 3, 1)]
    end = best_first(start, advance, 2, deadline=3, clock=lambda: next(ticks))
    assert advanced == [0, 1, 2]
    assert end.left == [(3.0, 3), (4.0, 4)] and not end.complete


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("width", [1, 4])
def test_candidates_released_by_another_are_searched_as_they_come(seed, width):
    """Chains of candidates, each figure no less than the one before it: only the first
    of a chain starts; the next is released, at least at the figure before it, when one
    does not count. The least figures are those of every candidate that may count: each
    chain's up to and including its first that counts."""
    rng = random.Random(seed)
    chains = []
    for index in range(12):
        figures = sorted(rng.uniform(1.0, 10.0) for _ in range(3))
        counts = [rng.random() > 0.5 for _ in figures]
        members = enumerate(zip(figures, counts, strict=True))
        chains.append([(f"c{index}.{i}", figure, c) for i, (figure, c) in members])
    advanced = []

    def advance(item):
        chain, place = item
        name, figure, counts = chains[chain][place]
        advanced.append(name)
        released = ()
        if not counts and place + 1 < len(chains[chain]):
            following = chains[chain][place + 1][1]
            released = ((max(figure, following * rng.uniform(0.5, 1.0)), (chain, place + 1)),)
        return Advance(estimated=True, figure=figure if counts else None, releases=released)

    start = [(chain[0][1] * 0.8, (index, 0)) for index, chain in enumerate(chains)]
    end = best_first(start, advance, 3, width=width)
    assert end.complete
    may_count = []
    for chain in chains:
        for _, figure, counts in chain:
            if counts:
                may_count.append(figure)
                break
    found = sorted(
        figure for chain in chains for name, figure, counts in chain if counts and name in advanced
    )
    assert found[:3] == sorted(may_count)[:3]
    # A chain's later candidates were advanced only after an earlier one did not count.
    for chain in chains:
        names = [name for name, _, _ in chain]
        for place, (_, _, counts) in enumerate(chain[:-1]):
            if counts:
                assert not set(names[place + 1 :]) & set(advanced)


def test_a_tighter_bound_keeps_its_place():
    """First bounds all under every tighter one (as the planner's screens of layouts lie
    under its screens of mappings): each candidate is tightened and then estimated at
    once, least first bound first, so a deadline after four advances keeps the two least
    figures; taken least bound first, the four would all have been tightenings."""
    first = {f"m{index}": 1.0 + 0.01 * index for index in range(10)}
    tighter = {name: bound + 1.0 for name, bound in first.items()}
    figure = {name: bound + 0.5 for name, bound in tighter.items()}
    advanced = []

    def advance(item):
        name, stage = item
        advanced.append(item)
        if stage == "first":
            return Advance(tighter[name], (name, "tighter"))
        return Advance(estimated=True, figure=figure[name])

    ticks = iter(range(100))
    end = best_first(
        ((bound, (name, "first")) for name, bound in first.items()),
        advance,
        2,
        deadline=4,
        clock=lambda: next(ticks),
    )
    assert advanced == [("m0", "first"), ("m0", "tighter"), ("m1", "first"), ("m1", "tighter")]
    assert not end.complete and len(end.left) == 8


def test_a_tighter_bound_ruled_out_by_then_is_left_in_its_place():
    """Taken two at a time, ``a`` goes back with a tighter bound (5.0) while ``b``'s
    figure (4.0) rules it out: ``a`` is still first in order, and is left there, not
    advanced; ``c``, whose bound is not ruled out, is advanced after it."""
    advanced = []
    steps = {
        "a": Advance(5.0, "a tighter"),
        "b": Advance(estimated=True, figure=4.0),
        "c": Advance(estimated=True, figure=9.0),
    }

    def advance(item):
        advanced.append(item)
        return steps[item]

    end = best_first([(1.0, "a"), (1.1, "b"), (1.2, "c")], advance, 1, width=2)
    assert advanced == ["a", "b", "c"]
    assert end.complete and end.left == [(5.0, "a tighter")]
