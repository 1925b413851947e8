"""schedule_dw: forced and best-fit packing of dW work into the backward windows."""

from __future__ import annotations

import pytest

from scheduling.passes import schedule_dw, split_async
from tests.scheduling.toys import fixed_seconds, toy_program
from tests.scheduling.window_toys import (
    chain_step,
    constant_step,
    cost_model_seconds,
    dw_candidates,
    forced_step,
    late_dw_step,
    two_window_step,
    two_windows,
    window_graph,
)

# schedule_dw: best fit.


@pytest.mark.parametrize(
    ("costs", "capacity", "expected"),
    [
        # closest to 10 is 9; then closest to 1 is 3, which is over twice 1: stop.
        ([3.0, 4.0, 6.0, 9.0, 25.0], 10.0, [3]),
        # 7 (3 left), then 4 (closest to 3, within twice): remaining -1 <= 0, stop.
        ([4.0, 5.0, 7.0, 50.0, 60.0], 10.0, [2, 0]),
        # an exact fit leaves 0: nothing more, however small.
        ([10.0, 1.0, 1.0, 1.0, 1.0], 10.0, [0]),
        # 8 (2 left), then 5 is over twice 2: stop.
        ([8.0, 5.0, 100.0, 100.0, 100.0], 10.0, [0]),
        # 8 (2 left), then 4 is exactly twice 2: still placed.
        ([8.0, 4.0, 100.0, 100.0, 100.0], 10.0, [0, 1]),
        # an empty window takes the best candidate even if it is far too big.
        ([5.0, 6.0, 7.0, 8.0, 9.0], 1.0, [0]),
    ],
    ids=["closest", "stop_at_zero", "exact_fit", "over_twice", "exactly_twice", "empty_window"],
)
def test_schedule_dw_greedy_best_fit(costs, capacity, expected):
    graph = window_graph(two_window_step)
    first, second = two_windows(graph)
    muls = dw_candidates(graph, first)
    assert len(muls) == 5
    assert dw_candidates(graph, second) == muls  # last window is the second: nothing forced
    seconds = {first.id: capacity, second.id: 0.0}
    seconds.update(zip(muls, costs, strict=True))
    placement = schedule_dw(graph, fixed_seconds(seconds))
    assert placement.windows[first.id] == [muls[i] for i in expected]
    # What is left has its last chance in the second window: forced in there.
    assert sorted(placement.windows[second.id]) == sorted(
        set(muls) - set(placement.windows[first.id])
    )
    assert placement.forced == set(placement.windows[second.id])


def test_schedule_dw_takes_a_candidate_only_once_its_inputs_exist():
    graph = window_graph(chain_step)
    first, _ = two_windows(graph)
    c1, c2 = dw_candidates(graph, first)
    assert graph.preds[c2] == {c1}
    # c2 alone would fit the window best, but it needs c1, which is placed first.
    costs = {first.id: 10.0, c1: 1.0, c2: 9.0}
    placement = schedule_dw(graph, fixed_seconds(costs))
    assert placement.windows[first.id] == [c1, c2]
    assert placement.forced == set()


@pytest.mark.parametrize("force", [True, False])
def test_work_on_the_steps_inputs_alone_comes_only_with_its_reader(force):
    graph = window_graph(constant_step)
    first, second = two_windows(graph)
    filled, cast, lone, product = dw_candidates(graph, first)
    assert graph.preds[product] - {cast} and graph.preds[cast] == {filled}
    assert not graph.preds[filled] and not graph.preds[lone]
    # ``lone`` fits the first window exactly, but would hide nothing there and only be
    # made early; the constant ``cast`` comes along with the product that reads it.
    costs = {first.id: 10.0, second.id: 10.0, filled: 1.0, cast: 1.0, product: 4.0, lone: 8.0}
    placement = schedule_dw(graph, fixed_seconds(costs), force=force)
    assert placement.windows[first.id] == [filled, cast, product]
    assert placement.windows[second.id] == []


def test_schedule_dw_forces_candidates_whose_last_window_this_is():
    graph = window_graph(forced_step)
    first, second = two_windows(graph)
    n1, n2, free = dw_candidates(graph, first)
    assert dw_candidates(graph, second) == [free]
    # Both forced nodes overflow a window of 1s, and are placed all the same.
    costs = {first.id: 1.0, second.id: 1.0, n1: 5.0, n2: 5.0, free: 0.5}
    placement = schedule_dw(graph, fixed_seconds(costs))
    assert placement.windows[first.id] == [n1, n2]
    assert placement.windows[second.id] == [free]
    assert placement.forced == {n1, n2, free}


def test_schedule_dw_forced_first_then_best_fit():
    graph = window_graph(forced_step)
    first, second = two_windows(graph)
    n1, n2, free = dw_candidates(graph, first)
    costs = {first.id: 10.0, second.id: 1.0, n1: 2.0, n2: 2.0, free: 5.0}
    placement = schedule_dw(graph, fixed_seconds(costs))
    assert placement.windows[first.id] == [n1, n2, free]
    assert placement.windows[second.id] == []
    assert placement.forced == {n1, n2}
    assert placement.window_of() == {n1: first.id, n2: first.id, free: first.id}


def _check_placement(graph, placement):
    """Every placed node is a candidate of its window and can run when it opens."""
    seen = set()
    done_windows = []
    for start_id, nodes in placement.windows.items():
        start = graph.nodes[start_id]
        candidates = graph.dw_candidates(start)
        closed = {
            n
            for s in done_windows
            if graph.has_path(graph.nodes[s].partner, start_id)
            for n in placement.windows[s]
        }
        for i, node in enumerate(nodes):
            assert node not in seen
            seen.add(node)
            assert candidates >> node & 1
            for pred in graph.preds[node]:
                assert graph.has_path(pred, start_id) or pred in nodes[:i] or pred in closed, (
                    node,
                    pred,
                )
        done_windows.append(start_id)
    assert placement.forced <= seen


@pytest.mark.parametrize("reg", [False, True], ids=["toy", "toy_reg"])
def test_schedule_dw_placements_are_candidates_with_inputs_ready(reg):
    graph = split_async(toy_program(reg))
    placement = schedule_dw(graph, cost_model_seconds(graph))
    assert any(placement.windows.values())
    _check_placement(graph, placement)


@pytest.mark.parametrize("step", [two_window_step, chain_step, forced_step, late_dw_step])
@pytest.mark.parametrize("capacity", [0.5, 3.0, 100.0])
def test_schedule_dw_placements_are_valid_on_synthetic_graphs(step, capacity):
    graph = window_graph(step)
    costs = {n.id: 1.0 + n.id % 3 for n in graph.nodes}
    costs.update({s.id: capacity for s in graph.starts()})
    _check_placement(graph, schedule_dw(graph, fixed_seconds(costs)))


def test_without_forcing_a_window_takes_only_its_best_fit():
    graph = window_graph(forced_step)
    first, second = two_windows(graph)
    n1, n2, free = dw_candidates(graph, first)
    costs = {first.id: 1.0, second.id: 1.0, n1: 5.0, n2: 5.0, free: 0.5}
    placement = schedule_dw(graph, fixed_seconds(costs), force=False)
    # The closest to the first window's 1s, then nothing over twice what is left.
    assert placement.windows[first.id] == [free]
    assert placement.windows[second.id] == []
    assert placement.forced == set()
