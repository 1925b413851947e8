"""The two-stream simulator: timelines of hand-built graphs with fixed costs, computed by
hand (synchronous and split collectives, host work, a busy link)."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.costs.simulate import simulate
from scheduling.passes import split_async
from scheduling.program.capture import capture
from scheduling.program.graph import Graph, Role
from tests.scheduling.toys import fixed_seconds, mesh_x, sds


def _one_a2a(w, x):
    a = x * 2.0
    t = jax.lax.all_to_all(a, "x", 0, 0, tiled=True)
    b = w * 3.0
    c = b * 4.0
    return t + c


def _one_a2a_program():
    mesh = mesh_x()
    return capture(
        _one_a2a,
        sds(mesh, (8, 4), P()),
        sds(mesh, (64, 4), P("x")),
        mesh=mesh,
        in_specs=(P(), P("x")),
        out_specs=P("x"),
    )


def test_sync_collective_blocks_compute_for_its_whole_time():
    graph = Graph(_one_a2a_program(), split=lambda op: False)
    assert [n.op.primitive for n in graph.nodes] == ["mul", "all_to_all", "mul", "mul", "add"]
    seconds = fixed_seconds({0: 1.0, 1: 5.0, 2: 2.0, 3: 2.0, 4: 1.0})
    timeline = simulate(graph, [0, 1, 2, 3, 4], seconds)
    assert timeline.step_seconds == 11.0
    assert timeline.compute_seconds == 6.0
    assert timeline.communication_seconds == 5.0
    timing = timeline.collectives[1]
    assert (timing.node, timing.issued, timing.began, timing.finished, timing.stall) == (
        1,
        1.0,
        1.0,
        6.0,
        5.0,
    )
    assert timeline.exposed_communication_seconds == 5.0


@pytest.mark.parametrize(
    ("compute_each", "stall", "step"),
    [(3.0, 0.0, 8.0), (2.5, 0.0, 7.0), (2.0, 1.0, 7.0), (0.5, 4.0, 7.0)],
)
def test_async_collective_stalls_only_for_what_compute_does_not_cover(compute_each, stall, step):
    graph = split_async(_one_a2a_program())
    roles = [(n.op.primitive, n.role) for n in graph.nodes]
    assert roles[1:3] == [("all_to_all", Role.START), ("all_to_all", Role.DONE)]
    seconds = fixed_seconds({0: 1.0, 1: 5.0, 3: compute_each, 4: compute_each, 5: 1.0})
    # The two independent muls run between start and done.
    timeline = simulate(graph, [0, 1, 3, 4, 2, 5], seconds)
    timing = timeline.collectives[1]
    assert (timing.issued, timing.began, timing.finished) == (1.0, 1.0, 6.0)
    assert timing.stall == pytest.approx(stall)
    assert timing.stall == pytest.approx(max(0.0, 5.0 - 2 * compute_each))
    assert timeline.step_seconds == pytest.approx(step)
    assert timeline.exposed_communication_seconds == pytest.approx(stall)
    assert timeline.compute_seconds == pytest.approx(2.0 + 2 * compute_each)


def test_host_work_of_a_collective_runs_on_the_compute_stream():
    # Issuing the transfer waits for the start's host work; the done's host work follows
    # the transfer. Neither counts as compute.
    graph = split_async(_one_a2a_program())
    seconds = fixed_seconds({0: 1.0, 1: 5.0, 3: 2.0, 4: 2.0, 5: 1.0})
    host = fixed_seconds({1: 0.5, 2: 0.25})
    timeline = simulate(graph, [0, 1, 3, 4, 2, 5], seconds, host=host)
    timing = timeline.collectives[1]
    assert (timing.issued, timing.finished, timing.stall) == (1.5, 6.5, 1.0)
    assert timeline.step_seconds == 1.0 + 0.5 + 4.0 + 1.0 + 0.25 + 1.0
    assert timeline.compute_seconds == 6.0
    # Unsplit, the collective's host work comes before it.
    graph = Graph(_one_a2a_program(), split=lambda op: False)
    sync = simulate(graph, [0, 1, 2, 3, 4], fixed_seconds({0: 1.0, 1: 5.0}), host=host)
    assert (sync.collectives[1].issued, sync.step_seconds) == (1.5, 6.5)


def test_async_collective_waited_at_once_is_as_slow_as_sync():
    graph = split_async(_one_a2a_program())
    seconds = fixed_seconds({0: 1.0, 1: 5.0, 3: 2.0, 4: 2.0, 5: 1.0})
    timeline = simulate(graph, [0, 1, 2, 3, 4, 5], seconds)
    assert timeline.collectives[1].stall == 5.0
    assert timeline.step_seconds == 11.0


def test_synchronous_backend_runs_a_split_collective_at_its_start():
    # XLA's CPU backend compiles a start/done pair back to one synchronous collective:
    # the compute stream waits for the whole transfer where the start stands.
    graph = split_async(_one_a2a_program())
    seconds = fixed_seconds({0: 1.0, 1: 5.0, 3: 2.0, 4: 2.0, 5: 1.0})
    timeline = simulate(graph, [0, 1, 3, 4, 2, 5], seconds, asynchronous=False)
    timing = timeline.collectives[1]
    assert (timing.issued, timing.began, timing.finished, timing.stall) == (1.0, 1.0, 6.0, 5.0)
    assert timeline.step_seconds == 11.0  # 7.0 on an asynchronous backend
    assert timeline.exposed_communication_seconds == 5.0
    assert timeline.compute_seconds == 6.0


def test_a_predicate_chooses_which_split_collectives_overlap():
    # The first all-to-all has the second one's input computation in its window; the
    # predicate says which split collectives overlap (socket all-to-alls beside XLA's
    # synchronous ones), the others run at their start.
    graph = split_async(_two_a2a_program())
    seconds = fixed_seconds({0: 3.0, 3: 3.0, 1: 4.0, 4: 4.0, 6: 1.0})
    order = [0, 1, 3, 2, 4, 5, 6]

    def step(asynchronous):
        return simulate(graph, order, seconds, asynchronous=asynchronous).step_seconds

    assert step(lambda node: node.id == 1) == step(True) == 3.0 + 3.0 + 1.0 + 4.0 + 1.0
    assert step(lambda node: node.id == 4) == step(False) == 3.0 + 4.0 + 3.0 + 4.0 + 1.0


def _two_a2a(x):
    t1 = jax.lax.all_to_all(x * 2.0, "x", 0, 0, tiled=True)
    t2 = jax.lax.all_to_all(x * 3.0, "x", 0, 0, tiled=True)
    return t1 + t2


def _two_a2a_program():
    mesh = mesh_x()
    return capture(
        _two_a2a, sds(mesh, (64, 4), P("x")), mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )


def test_communication_stream_serialises_collectives_started_together():
    graph = split_async(_two_a2a_program())
    kinds = [(n.op.primitive, n.role.value) for n in graph.nodes]
    assert kinds == [
        ("mul", "compute"), ("all_to_all", "start"), ("all_to_all", "done"),
        ("mul", "compute"), ("all_to_all", "start"), ("all_to_all", "done"),
        ("add", "compute"),
    ]  # fmt: skip
    seconds = fixed_seconds({0: 1.0, 3: 1.0, 1: 4.0, 4: 4.0, 6: 1.0})
    timeline = simulate(graph, [0, 3, 1, 4, 2, 5, 6], seconds)
    first, second = timeline.collectives[1], timeline.collectives[4]
    assert (first.issued, first.began, first.finished, first.stall) == (2.0, 2.0, 6.0, 4.0)
    # Issued at the same time, but the link is busy until the first one finishes.
    assert (second.issued, second.began, second.finished, second.stall) == (2.0, 6.0, 10.0, 4.0)
    assert timeline.step_seconds == 11.0
    assert timeline.communication_seconds == 8.0
    assert timeline.compute_seconds == 3.0
    assert timeline.exposed_communication_seconds == 8.0


def test_sync_collective_waits_for_the_link_then_for_its_transfer():
    program = _two_a2a_program()
    first_a2a = program.collectives()[0]
    graph = Graph(program, split=lambda op: op is first_a2a)
    kinds = [(n.op.primitive, n.role.value) for n in graph.nodes]
    assert kinds == [
        ("mul", "compute"), ("all_to_all", "start"), ("all_to_all", "done"),
        ("mul", "compute"), ("all_to_all", "compute"), ("add", "compute"),
    ]  # fmt: skip
    seconds = fixed_seconds({0: 1.0, 1: 4.0, 3: 1.0, 4: 4.0, 5: 1.0})
    timeline = simulate(graph, [0, 1, 3, 4, 2, 5], seconds)
    async_timing, sync_timing = timeline.collectives[1], timeline.collectives[4]
    assert (async_timing.began, async_timing.finished, async_timing.stall) == (1.0, 5.0, 0.0)
    # Reached at 2, the link is free at 5, the transfer ends at 9: 7 lost.
    assert (sync_timing.issued, sync_timing.began, sync_timing.finished) == (2.0, 5.0, 9.0)
    assert sync_timing.stall == 7.0
    assert timeline.step_seconds == 10.0
