"""The list scheduler: the order honours placements and priorities, keeps the live-bytes
bound, and withdraws placements that close a cycle."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.order.list_scheduler import fewest_within, order, peak_live_bytes
from scheduling.passes import Placement, schedule_dw, split_async
from scheduling.program.capture import capture
from scheduling.program.graph import Graph, Role
from tests.scheduling.toys import fixed_seconds, mesh_x, sds, toy_program
from tests.scheduling.window_toys import (
    a2a,
    chain_step,
    cost_model_seconds,
    dw_candidates,
    forced_step,
    late_dw_step,
    memory_step,
    two_window_step,
    two_windows,
    window_graph,
)


def _check_order(graph, ordered, priorities=()):
    result = ordered.nodes
    assert sorted(result) == list(range(len(graph.nodes)))
    position = {node: i for i, node in enumerate(result)}
    for node in graph.nodes:
        for pred in graph.preds[node.id]:
            assert position[pred] < position[node.id]
    window_of = ordered.placement.window_of()
    for start_id, nodes in ordered.placement.windows.items():
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
        lambda: (window_graph(two_window_step), 3.0),
        lambda: (window_graph(chain_step), 3.0),
        lambda: (window_graph(forced_step), 3.0),
    ],
    ids=["toy", "two_windows", "chain", "forced"],
)
def test_order_is_topological_and_honours_windows(make):
    graph, capacity = make()
    if capacity is None:
        seconds = cost_model_seconds(graph)
    else:
        costs = {n.id: 1.0 for n in graph.nodes}
        costs.update({s.id: capacity for s in graph.starts()})
        seconds = fixed_seconds(costs)
    placement = schedule_dw(graph, seconds)
    assert any(placement.windows.values())
    ordered = order(graph, placement, max_live_bytes_growth=math.inf)
    assert ordered.withdrawn == []
    _check_order(graph, ordered)


def test_only_the_placements_that_close_a_cycle_are_withdrawn():
    # ``b`` reads the first window's all-to-all and feeds the second's: placed in the first
    # window it closes a cycle (done -> b -> done). The node placed in the second window
    # after it waits behind that cycle, but closes none: it stays, as does the one before.
    graph = window_graph(two_window_step)
    first, second = two_windows(graph)
    b = next(n for n in sorted(graph.succs[first.partner]) if graph.nodes[n].role is Role.COMPUTE)
    c5, c7 = dw_candidates(graph, first)[:2]
    placement = Placement({first.id: [c5, b], second.id: [c7]})
    ordered = order(graph, placement, max_live_bytes_growth=math.inf)
    assert ordered.withdrawn == [b]
    assert ordered.withdrawn_for_bound == 0  # a cycle's, not the bound's
    assert ordered.placement.windows == {first.id: [c5], second.id: [c7]}
    _check_order(graph, ordered)


def test_order_without_placement_starts_early_and_waits_late():
    graph = split_async(toy_program())
    ordered = order(graph, Placement())
    _check_order(graph, ordered)
    position = {node: i for i, node in enumerate(ordered.nodes)}
    for start in graph.starts():
        last = max(position[p] for p in graph.preds[start.id])
        assert position[start.id] == last + 1
    # The loss psum has no consumer: its done is the very last node.
    assert graph.nodes[ordered.nodes[-1]].role is Role.DONE


def test_order_of_unsplit_graph_is_program_order():
    graph = Graph(toy_program(), split=lambda op: False)
    ordered = order(graph, Placement())
    assert ordered.nodes == list(range(len(graph.nodes)))
    assert ordered.peak_live_bytes == ordered.baseline_peak_live_bytes


@pytest.mark.parametrize("case", ["late_dw", "toy_reg"])
def test_start_follows_a_placed_producer_moved_earlier(case):
    if case == "late_dw":
        graph = window_graph(late_dw_step)
        first, second = two_windows(graph)
        (d,) = dw_candidates(graph, first)
        seconds = fixed_seconds({first.id: 10.0, second.id: 10.0, d: 9.0}, default=1.0)
    else:
        graph = split_async(toy_program(reg=True))
        seconds = cost_model_seconds(graph)
    placement = schedule_dw(graph, seconds)
    ordered = order(graph, placement, max_live_bytes_growth=math.inf)
    # Precondition: some collective is fed
    # by a placed node that now runs earlier than its program position.
    window_of = placement.window_of()
    fed = [
        s
        for s in graph.starts()
        for p in graph.preds[s.id]
        if p in window_of and ordered.nodes.index(p) < p
    ]
    if not fed:
        raise RuntimeError("precondition: no start is fed by a node moved earlier")
    _check_order(graph, ordered)


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
        return a2a(x), y

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
    graph = window_graph(memory_step, w_shape=(64, 32), x_shape=(64, 128))
    first, second = two_windows(graph)
    big, total = dw_candidates(graph, first)
    costs = {first.id: 10.0, second.id: 10.0, big: 9.0, total: 100.0}
    seconds = fixed_seconds(costs, default=1.0)

    unplaced = order(graph, Placement(), max_live_bytes_growth=0.0)
    assert unplaced.peak_live_bytes <= unplaced.baseline_peak_live_bytes
    assert unplaced.baseline_peak_live_bytes == peak_live_bytes(
        graph, list(range(len(graph.nodes)))
    )

    loose = order(graph, schedule_dw(graph, seconds), max_live_bytes_growth=math.inf)
    assert loose.withdrawn == []
    assert loose.withdrawn_for_bound == 0
    assert loose.placement.windows[first.id] == [big]
    assert loose.peak_live_bytes > loose.baseline_peak_live_bytes  # the placement costs memory

    tight = order(graph, schedule_dw(graph, seconds), max_live_bytes_growth=0.0)
    assert tight.withdrawn
    assert tight.withdrawn[0] == big  # the largest output goes first
    assert tight.withdrawn_for_bound == len(tight.withdrawn)
    assert tight.peak_live_bytes <= tight.baseline_peak_live_bytes
    assert tight.peak_live_bytes == peak_live_bytes(graph, tight.nodes)
    assert not set(tight.withdrawn) & set(tight.placement.window_of())
    _check_order(graph, tight)


def test_a_placement_that_adds_nothing_to_the_priorities_peak_is_kept():
    # Priorities alone exceed the bound (``big`` first holds it through both windows); the
    # placement of ``total`` (its sum, which frees it sooner) adds nothing to that peak.
    graph = window_graph(memory_step, w_shape=(64, 32), x_shape=(64, 128))
    first, _ = two_windows(graph)
    big, total = dw_candidates(graph, first)
    priorities = {big: -1.0}
    alone = order(graph, Placement(), max_live_bytes_growth=0.0, priorities=priorities)
    assert alone.live_bytes_bound_exceeded  # precondition

    placement = Placement({first.id: [total]})
    ordered = order(graph, placement, max_live_bytes_growth=0.0, priorities=priorities)
    assert ordered.withdrawn == []
    assert ordered.placement.windows[first.id] == [total]
    assert ordered.peak_live_bytes <= alone.peak_live_bytes
    assert ordered.live_bytes_bound_exceeded
    _check_order(graph, ordered, priorities)


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


def _two_collectives_of_one_value(x):
    """Two collectives of one value: the first in program order is read last."""
    y = jnp.tanh(x)
    read_last = jax.lax.psum(y, "x")
    read_first = jax.lax.all_gather(y, "x", tiled=True)
    z = jnp.tanh(read_first).sum()
    return jnp.tanh(read_last) + z


def test_starts_ready_together_go_in_the_order_their_results_are_read():
    mesh = mesh_x()
    program = capture(
        _two_collectives_of_one_value, sds(mesh, (8, 8), P("x")),
        mesh=mesh, in_specs=(P("x"),), out_specs=P("x"),
    )  # fmt: skip
    graph = split_async(program)
    read_last, read_first = graph.starts()
    ordered = order(graph, Placement(), 0.1)
    _check_order(graph, ordered)
    position = {node: i for i, node in enumerate(ordered.nodes)}
    # Both start once their operand exists; the link gets first what is read first.
    assert position[read_first.id] < position[read_last.id]
    assert position[read_last.id] < position[read_first.partner]


@pytest.mark.parametrize("hint", [None, 0, 1, 36, 37, 38, 100, 999, 1000, 5000])
def test_a_hint_finds_the_same_fewest_withdrawals(hint):
    """However wrong the hint, the bisection finds the fewest count within the bound; a
    right one in two questions (the count and the one before it)."""
    asked = []

    def within(count):
        asked.append(count)
        return count >= 37

    assert fewest_within(within, 1000, hint) == 37
    assert 1000 not in asked and 0 not in asked  # known: all within, none over
    if hint == 37:
        assert asked == [37, 36]
    elif hint is None:
        assert len(asked) == math.ceil(math.log2(1000))


def test_an_order_given_its_own_withdrawals_as_the_hint_is_the_same():
    # As test_live_bytes_bound_withdraws_placements: the tight order withdraws; given its
    # count as the hint, the same order comes back.
    graph = window_graph(memory_step, w_shape=(64, 32), x_shape=(64, 128))
    first, second = two_windows(graph)
    big, total = dw_candidates(graph, first)
    seconds = fixed_seconds({first.id: 10.0, second.id: 10.0, big: 9.0, total: 100.0}, 1.0)
    tight = order(graph, schedule_dw(graph, seconds), max_live_bytes_growth=0.0)
    assert tight.withdrawn_for_bound
    hinted = order(
        graph,
        schedule_dw(graph, seconds),
        max_live_bytes_growth=0.0,
        withdrawn_hint=tight.withdrawn_for_bound,
    )
    assert (hinted.nodes, hinted.withdrawn, hinted.peak_live_bytes) == (
        tight.nodes,
        tight.withdrawn,
        tight.peak_live_bytes,
    )
