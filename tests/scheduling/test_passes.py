"""passes: schedule_dw's forced and best-fit packing, order's placement and live-bytes bound."""

from __future__ import annotations

import math

import jax
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.costs.cost_model import CostModel
from scheduling.profiles import PROFILES
from scheduling.passes import Placement, order, schedule_dw, split_async
from scheduling.order.list_scheduler import peak_live_bytes
from scheduling.program.capture import capture
from scheduling.program.graph import Graph, Role
from tests.scheduling.toys import as_backward, fixed_seconds, mesh_x, sds, toy_program

# Synthetic "backward passes": forward-only programs whose ops are all marked backward,
# so that each all_to_all is a dW window and the work on ``w`` is a dW candidate.


def _a2a(v):
    return jax.lax.all_to_all(v, "x", 0, 0, tiled=True)


def _two_window_step(w, x):
    a = x * 2.0
    t1 = _a2a(a)
    b = t1 * 3.0
    t2 = _a2a(b)
    return (t2, *(w * c for c in (5.0, 7.0, 11.0, 13.0, 17.0)))


def _chain_step(w, x):
    t1 = _a2a(x * 2.0)
    t2 = _a2a(t1 * 3.0)
    c1 = w * 5.0
    c2 = c1 * 7.0
    return t2, c2


def _forced_step(w, x):
    t1 = _a2a(x * 2.0)
    n1 = w * 5.0  # needed by the second all_to_all: its last window is the first
    n2 = w * 7.0
    b = (t1 + n1) + n2
    t2 = _a2a(b)
    free = w * 11.0  # a candidate of both windows
    return t2, free


def _late_dw_step(w, x):
    t1 = _a2a(x * 2.0)
    t2 = _a2a(t1 * 3.0)
    c = t2 * 5.0
    d = w * 7.0  # after everything in program order, a candidate of both windows
    return c, jax.lax.psum(d, "x")


def _memory_step(w, x):
    t1 = _a2a(x * 2.0)
    t2 = _a2a(t1 * 3.0)
    s = t2.sum()
    big = w * 5.0
    return s + big.sum()


def _graph(step, w_shape=(8, 4), x_shape=(64, 4)):
    mesh = mesh_x()
    program = capture(
        step,
        sds(mesh, w_shape, P()),
        sds(mesh, x_shape, P("x")),
        mesh=mesh,
        in_specs=(P(), P("x")),
        out_specs=P(),
    )
    return split_async(as_backward(program))


def _windows(graph):
    starts = graph.backward_all_to_alls()
    assert len(starts) == 2
    return starts


def _candidates(graph, start):
    return graph.members(graph.dw_candidates(start))


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
    graph = _graph(_two_window_step)
    first, second = _windows(graph)
    muls = _candidates(graph, first)
    assert len(muls) == 5
    assert _candidates(graph, second) == muls  # last window is the second: nothing forced
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
    graph = _graph(_chain_step)
    first, _ = _windows(graph)
    c1, c2 = _candidates(graph, first)
    assert graph.preds[c2] == {c1}
    # c2 alone would fit the window best, but it needs c1, which is placed first.
    costs = {first.id: 10.0, c1: 1.0, c2: 9.0}
    placement = schedule_dw(graph, fixed_seconds(costs))
    assert placement.windows[first.id] == [c1, c2]
    assert placement.forced == set()


def test_schedule_dw_forces_candidates_whose_last_window_this_is():
    graph = _graph(_forced_step)
    first, second = _windows(graph)
    n1, n2, free = _candidates(graph, first)
    assert _candidates(graph, second) == [free]
    # Both forced nodes overflow a window of 1s, and are placed all the same.
    costs = {first.id: 1.0, second.id: 1.0, n1: 5.0, n2: 5.0, free: 0.5}
    placement = schedule_dw(graph, fixed_seconds(costs))
    assert placement.windows[first.id] == [n1, n2]
    assert placement.windows[second.id] == [free]
    assert placement.forced == {n1, n2, free}


def test_schedule_dw_forced_first_then_best_fit():
    graph = _graph(_forced_step)
    first, second = _windows(graph)
    n1, n2, free = _candidates(graph, first)
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


def _cost_model_seconds(graph):
    cost = CostModel(PROFILES["a100"], dict(graph.program.mesh.shape))
    return lambda node: 0.0 if node.role is Role.DONE else cost.seconds(node.op)


@pytest.mark.parametrize("reg", [False, True], ids=["toy", "toy_reg"])
def test_schedule_dw_placements_are_candidates_with_inputs_ready(reg):
    graph = split_async(toy_program(reg))
    placement = schedule_dw(graph, _cost_model_seconds(graph))
    assert any(placement.windows.values())
    _check_placement(graph, placement)


@pytest.mark.parametrize("step", [_two_window_step, _chain_step, _forced_step, _late_dw_step])
@pytest.mark.parametrize("capacity", [0.5, 3.0, 100.0])
def test_schedule_dw_placements_are_valid_on_synthetic_graphs(step, capacity):
    graph = _graph(step)
    costs = {n.id: 1.0 + n.id % 3 for n in graph.nodes}
    costs.update({s.id: capacity for s in graph.starts()})
    _check_placement(graph, schedule_dw(graph, fixed_seconds(costs)))


# order.


def _check_order(graph, schedule, priorities=()):
    result = schedule.order
    assert sorted(result) == list(range(len(graph.nodes)))
    position = {node: i for i, node in enumerate(result)}
    for node in graph.nodes:
        for pred in graph.preds[node.id]:
            assert position[pred] < position[node.id]
    window_of = schedule.placement.window_of()
    for start_id, nodes in schedule.placement.windows.items():
        done = graph.nodes[start_id].partner
        for node in nodes:
            assert position[start_id] < position[node] < position[done]
        # In placement order.
        assert [position[n] for n in nodes] == sorted(position[n] for n in nodes)
    for node in graph.nodes:
        if node.role is Role.DONE:
            consumers = graph.succs[node.id]
            if consumers:
                assert position[node.id] < min(position[c] for c in consumers)
        if node.role is Role.START:
            last = max((position[p] for p in graph.preds[node.id]), default=-1)
            between = result[last + 1 : position[node.id]]
            assert all(graph.nodes[b].role is Role.START or b in window_of for b in between), (
                node,
                [graph.nodes[b] for b in between],
            )
    # Compute nodes that were not placed, nor given a priority, keep their program order.
    moved = set(window_of) | set(priorities)
    kept = [n for n in result if graph.nodes[n].role is Role.COMPUTE and n not in moved]
    assert kept == sorted(kept)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (split_async(toy_program()), None),
        lambda: (_graph(_two_window_step), 3.0),
        lambda: (_graph(_chain_step), 3.0),
        lambda: (_graph(_forced_step), 3.0),
    ],
    ids=["toy", "two_windows", "chain", "forced"],
)
def test_order_is_topological_and_honours_windows(make):
    graph, capacity = make()
    if capacity is None:
        seconds = _cost_model_seconds(graph)
    else:
        costs = {n.id: 1.0 for n in graph.nodes}
        costs.update({s.id: capacity for s in graph.starts()})
        seconds = fixed_seconds(costs)
    placement = schedule_dw(graph, seconds)
    assert any(placement.windows.values())
    schedule = order(graph, placement, max_live_bytes_growth=math.inf)
    assert schedule.withdrawn == []
    _check_order(graph, schedule)


def test_only_the_placements_that_close_a_cycle_are_withdrawn():
    # ``b`` reads the first window's all-to-all and feeds the second's: placed in the first
    # window it closes a cycle (done -> b -> done). The node placed in the second window
    # after it waits behind that cycle, but closes none: it stays, as does the one before.
    graph = _graph(_two_window_step)
    first, second = _windows(graph)
    b = next(n for n in sorted(graph.succs[first.partner]) if graph.nodes[n].role is Role.COMPUTE)
    c5, c7 = _candidates(graph, first)[:2]
    placement = Placement({first.id: [c5, b], second.id: [c7]})
    schedule = order(graph, placement, max_live_bytes_growth=math.inf)
    assert schedule.withdrawn == [b]
    assert schedule.placement.windows == {first.id: [c5], second.id: [c7]}
    _check_order(graph, schedule)


def test_order_without_placement_starts_early_and_waits_late():
    graph = split_async(toy_program())
    schedule = order(graph, Placement())
    _check_order(graph, schedule)
    position = {node: i for i, node in enumerate(schedule.order)}
    for start in graph.starts():
        last = max(position[p] for p in graph.preds[start.id])
        assert position[start.id] == last + 1
    # The loss psum has no consumer: its done is the very last node.
    assert graph.nodes[schedule.order[-1]].role is Role.DONE


def test_order_of_unsplit_graph_is_program_order():
    graph = Graph(toy_program(), split=lambda op: False)
    schedule = order(graph, Placement())
    assert schedule.order == list(range(len(graph.nodes)))
    assert schedule.peak_live_bytes == schedule.baseline_peak_live_bytes


@pytest.mark.parametrize("case", ["late_dw", "toy_reg"])
def test_start_follows_a_placed_producer_moved_earlier(case):
    if case == "late_dw":
        graph = _graph(_late_dw_step)
        first, second = _windows(graph)
        (d,) = _candidates(graph, first)
        seconds = fixed_seconds({first.id: 10.0, second.id: 10.0, d: 9.0}, default=1.0)
    else:
        graph = split_async(toy_program(reg=True))
        seconds = _cost_model_seconds(graph)
    placement = schedule_dw(graph, seconds)
    schedule = order(graph, placement, max_live_bytes_growth=math.inf)
    # Precondition: some collective is fed
    # by a placed node that now runs earlier than its program position.
    window_of = placement.window_of()
    fed = [
        s
        for s in graph.starts()
        for p in graph.preds[s.id]
        if p in window_of and schedule.order.index(p) < p
    ]
    if not fed:
        raise RuntimeError("precondition: no start is fed by a node moved earlier")
    _check_order(graph, schedule)


# Live bytes.


def test_peak_live_bytes_by_hand():
    mesh = mesh_x()

    def step(x):
        a = x * 2.0
        return a * 3.0

    program = capture(step, sds(mesh, (8, 4), P()), mesh=mesh, in_specs=P(), out_specs=P())
    graph = Graph(program, split=lambda op: False)
    nbytes = 8 * 4 * 4
    # Node 0: x and a; node 1: a and the result.
    assert peak_live_bytes(graph, [0, 1]) == 2 * nbytes


def test_async_result_lives_from_its_start():
    mesh = mesh_x()

    def step(x):
        y = x * 2.0
        return _a2a(x), y

    program = capture(
        step, sds(mesh, (64, 4), P("x")), mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))
    )
    graph = split_async(program)
    nbytes = 8 * 4 * 4
    mul, start, done = 0, 1, 2
    assert [graph.nodes[n].role for n in (start, done)] == [Role.START, Role.DONE]
    # x, y, and the all_to_all's result are all alive at once, whatever the order.
    assert peak_live_bytes(graph, [mul, start, done]) == 3 * nbytes
    # Started first: x and the result at the start, then y too.
    assert peak_live_bytes(graph, [start, mul, done]) == 3 * nbytes


def test_live_bytes_bound_withdraws_placements():
    # w is large, so placing `big = w * 5` during the all_to_all chain raises the peak.
    graph = _graph(_memory_step, w_shape=(64, 32), x_shape=(64, 128))
    first, second = _windows(graph)
    big, total = _candidates(graph, first)
    costs = {first.id: 10.0, second.id: 10.0, big: 9.0, total: 100.0}
    seconds = fixed_seconds(costs, default=1.0)

    unplaced = order(graph, Placement(), max_live_bytes_growth=0.0)
    assert unplaced.peak_live_bytes <= unplaced.baseline_peak_live_bytes
    assert unplaced.baseline_peak_live_bytes == peak_live_bytes(
        graph, list(range(len(graph.nodes)))
    )

    loose = order(graph, schedule_dw(graph, seconds), max_live_bytes_growth=math.inf)
    assert loose.withdrawn == []
    assert loose.placement.windows[first.id] == [big]
    assert loose.peak_live_bytes > loose.baseline_peak_live_bytes  # the placement costs memory

    tight = order(graph, schedule_dw(graph, seconds), max_live_bytes_growth=0.0)
    assert tight.withdrawn
    assert tight.withdrawn[0] == big  # the largest output goes first
    assert tight.peak_live_bytes <= tight.baseline_peak_live_bytes
    assert tight.peak_live_bytes == peak_live_bytes(graph, tight.order)
    assert not set(tight.withdrawn) & set(tight.placement.window_of())
    _check_order(graph, tight)


def test_a_placement_that_adds_nothing_to_the_priorities_peak_is_kept():
    # Priorities alone exceed the bound (``big`` first holds it through both windows); the
    # placement of ``total`` (its sum, which frees it sooner) adds nothing to that peak.
    graph = _graph(_memory_step, w_shape=(64, 32), x_shape=(64, 128))
    first, _ = _windows(graph)
    big, total = _candidates(graph, first)
    priorities = {big: -1.0}
    alone = order(graph, Placement(), max_live_bytes_growth=0.0, priorities=priorities)
    assert alone.live_bytes_bound_exceeded  # precondition

    placement = Placement({first.id: [total]})
    schedule = order(graph, placement, max_live_bytes_growth=0.0, priorities=priorities)
    assert schedule.withdrawn == []
    assert schedule.placement.windows[first.id] == [total]
    assert schedule.peak_live_bytes <= alone.peak_live_bytes
    assert schedule.live_bytes_bound_exceeded
    _check_order(graph, schedule, priorities)


def test_an_async_operand_stays_live_until_the_collective_is_done():
    def step(x):
        operand = x * 2.0  # read by the all-to-all only
        exchanged = jax.lax.all_to_all(operand, "x", 0, 0, tiled=True)
        return exchanged, x * 3.0  # independent work that can run in the window

    mesh = mesh_x()
    program = capture(
        step, sds(mesh, (64, 4), P("x")), mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))
    )
    graph = split_async(program)
    roles = [node.role for node in graph.nodes]
    assert roles == [Role.COMPUTE, Role.START, Role.DONE, Role.COMPUTE]
    buffer = 8 * 4 * 4  # one per-device [8, 4] float32 value
    # x, the operand still in flight, the exchanged result and x * 3 all at once.
    assert peak_live_bytes(graph, [0, 1, 3, 2]) == 4 * buffer


def test_order_does_not_change_the_callers_placement():
    graph = split_async(toy_program())
    windows = {start.id: 100.0 for start in graph.backward_all_to_alls()}
    placement = schedule_dw(graph, fixed_seconds(windows, default=1.0))
    assert any(placement.windows.values())
    before = {start: list(nodes) for start, nodes in placement.windows.items()}
    order(graph, placement, max_live_bytes_growth=0.0)
    assert placement.windows == before
