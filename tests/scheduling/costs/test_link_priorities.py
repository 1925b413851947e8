"""Collective priorities: which collectives are deferrable, and the link serving classes."""

from __future__ import annotations

import functools

import jax
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.costs.simulate import simulate
from scheduling.order.list_scheduler import order
from scheduling.passes import Placement, split_async
from scheduling.program.capture import capture
from scheduling.reports.describe import why
from tests.scheduling.toys import fixed_seconds, mesh_x, sds


def _step(x):
    t1 = jax.lax.all_to_all(x * 2.0, "x", 0, 0, tiled=True)
    gradient_like = jax.lax.psum(x * 3.0, "x")  # only returned: deferrable
    t2 = jax.lax.all_to_all(x * 5.0, "x", 0, 0, tiled=True)
    tensor_parallel = jax.lax.psum(x * 13.0, "x")  # read by the next computation
    return gradient_like, t1 * 7.0 + t2 * tensor_parallel


@functools.cache
def _graph():
    mesh = mesh_x()
    program = capture(
        _step, sds(mesh, (64, 4), P("x")), mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"))
    )
    graph = split_async(program)
    layout = [(n.op.primitive, n.role.value) for n in graph.nodes]
    assert layout == [
        ("mul", "compute"), ("all_to_all", "start"), ("all_to_all", "done"),
        ("mul", "compute"), ("psum", "start"), ("psum", "done"),
        ("mul", "compute"), ("all_to_all", "start"), ("all_to_all", "done"),
        ("mul", "compute"), ("psum", "start"), ("psum", "done"),
        ("mul", "compute"), ("mul", "compute"), ("add", "compute"),
    ]  # fmt: skip
    return graph


# Every compute node 1 s; the all-to-alls and the returned psum 4 s, the other psum 2 s.
SECONDS = fixed_seconds({1: 4.0, 4: 4.0, 7: 4.0, 10: 2.0}, default=1.0)
# All four started as early as they can, each waited for where it is read.
ORDER = [0, 1, 3, 4, 6, 7, 9, 10, 2, 12, 8, 11, 13, 14, 5]


def test_only_collectives_that_no_training_computation_reads_are_deferrable():
    assert _graph().deferrable == {4}


def test_critical_collectives_go_before_a_waiting_gradient_reduction():
    timeline = simulate(_graph(), ORDER, SECONDS)
    # a2a 1-5; at 5 the psum (issued at 2), a2a (3) and tensor-parallel psum (4) wait:
    # the critical two go first, in start order (5-9, 9-11), the deferrable one last.
    spans = {n: (t.began, t.finished) for n, t in timeline.collectives.items()}
    assert spans == {1: (1.0, 5.0), 7: (5.0, 9.0), 10: (9.0, 11.0), 4: (11.0, 15.0)}
    stalls = {n: t.stall for n, t in timeline.collectives.items()}
    # Compute reaches the dones at 4, 6, 9 and 13 (after the last two muls).
    assert stalls == {1: 1.0, 7: 3.0, 10: 2.0, 4: 2.0}
    assert timeline.step_seconds == 15.0
    assert timeline.collectives[4].deferrable and not timeline.collectives[7].deferrable


def test_without_priorities_the_link_serves_collectives_in_start_order():
    timeline = simulate(_graph(), ORDER, SECONDS, priorities=False)
    spans = {n: (t.began, t.finished) for n, t in timeline.collectives.items()}
    assert spans == {1: (1.0, 5.0), 4: (5.0, 9.0), 7: (9.0, 13.0), 10: (13.0, 15.0)}
    # The all-to-all waited for behind the gradient reduction: 13 - 6.
    assert timeline.collectives[7].stall == 7.0
    assert timeline.step_seconds == 17.0


@pytest.mark.parametrize("priorities", [True, False])
def test_a_transfer_once_begun_is_not_interrupted(priorities):
    # The psum is started first, on an idle link: the all-to-all issued after it waits.
    order = [3, 4, 0, 1, 6, 7, 9, 10, 2, 12, 8, 11, 13, 14, 5]
    timeline = simulate(_graph(), order, SECONDS, priorities=priorities)
    assert (timeline.collectives[4].began, timeline.collectives[4].finished) == (1.0, 5.0)
    assert timeline.collectives[1].began == 5.0


def _same_operand(x):
    y = x * 2.0
    gradient_like = jax.lax.psum(y, "x")
    t = jax.lax.all_to_all(y, "x", 0, 0, tiled=True)
    return gradient_like, t * 3.0


def _same_operand_graph():
    mesh = mesh_x()
    program = capture(
        _same_operand,
        sds(mesh, (64, 4), P("x")),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=(P(), P("x")),
    )
    graph = split_async(program)
    starts = {n.op.primitive: n.id for n in graph.nodes if n.role.value == "start"}
    assert graph.deferrable == {starts["psum"]}
    return graph, starts


def test_order_starts_the_critical_collective_first_when_both_are_ready():
    graph, starts = _same_operand_graph()
    result = order(graph, Placement()).nodes
    assert result.index(starts["all_to_all"]) < result.index(starts["psum"])
    # In program order the psum comes first.
    assert starts["psum"] < starts["all_to_all"]


def test_the_report_says_what_held_the_link_before_a_stalled_collective():
    graph = _graph()
    fifo = simulate(graph, ORDER, SECONDS, priorities=False)
    # The second all-to-all, issued at 3, began at 9: the first all-to-all held the link
    # until 5, then the gradient reduction until 9.
    assert fifo.link_holders(3.0, 9.0) == (2.0, 4.0)
    reason = why(graph, fifo, fifo.collectives[7], 4.0, None)
    assert "link busy with gradient reductions" in reason
    assert "link busy with critical collectives" in reason
    # With priorities it waits for the first all-to-all alone.
    ranked = simulate(graph, ORDER, SECONDS)
    assert ranked.link_holders(3.0, 5.0) == (2.0, 0.0)
    assert "gradient reductions" not in why(graph, ranked, ranked.collectives[7], 4.0, None)
    # The first one was awaited after one op of work: 3 s of its 4 s are exposed.
    assert why(graph, ranked, ranked.collectives[1], 4.0, None).startswith("3e+03 ms of work")


def test_a_collective_that_moves_nothing_does_not_wait_for_the_link():
    # The tensor-parallel psum priced at nothing (as one over a single device's axes is:
    # the identity, which XLA removes), run at its start at 4 while the first all-to-all
    # holds the link and the second waits for it: it finishes there, not at 9 behind them.
    seconds = fixed_seconds({1: 4.0, 4: 4.0, 7: 4.0, 10: 0.0}, default=1.0)
    timeline = simulate(_graph(), ORDER, seconds, asynchronous=lambda node: node.id != 10)
    nothing = timeline.collectives[10]
    assert (nothing.issued, nothing.began, nothing.finished, nothing.stall) == (4.0, 4.0, 4.0, 0.0)
    assert 10 not in {event.node for event in timeline.events if event.stream == "communication"}
    # The others are served as before: the all-to-alls one after the other, then the
    # gradient reduction.
    spans = {n: (t.began, t.finished) for n, t in timeline.collectives.items() if n != 10}
    assert spans == {1: (1.0, 5.0), 7: (5.0, 9.0), 4: (9.0, 13.0)}
