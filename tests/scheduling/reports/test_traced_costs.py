"""Op costs from a trace of the compiled step: every traced second to one node of the schedule."""

from __future__ import annotations

import jax
import pytest

import scheduling
from scheduling import MeasuredOps, Role, node_seconds, traced_costs
from tests.scheduling.toys import in_specs, mesh_x, out_specs, toy_args, toy_step

POLICY = scheduling.SchedulePolicy(name="dw", profile=scheduling.PROFILES["cpu"])
# The name scopes of a transport's start and done callbacks (the socket transport's).
SCOPES = ("socket_start", "socket_done")


@pytest.fixture(scope="module")
def captured():
    program = scheduling.capture(
        toy_step, *toy_args(), mesh=mesh_x(), in_specs=in_specs(), out_specs=out_specs()
    )
    return program, scheduling.cost_model(POLICY, mesh_x())


@pytest.fixture(scope="module")
def scheduled(captured):
    program, cost = captured
    return scheduling.schedule(program, POLICY, cost), node_seconds(cost)


def _nodes(graph, primitive, stack, role=Role.COMPUTE):
    return [
        n
        for n in graph.nodes
        if n.op.primitive == primitive and n.op.name_stack == stack and n.role is role
    ]


def test_a_traced_step_gives_each_second_to_one_node(scheduled, tmp_path):
    result, estimate = scheduled
    step, _ = scheduling.optimize(
        toy_step, *toy_args(), mesh=mesh_x(), in_specs=in_specs(), out_specs=out_specs(),
        policy=POLICY,
    )  # fmt: skip
    args = toy_args()
    hlo_text = step.lower(*args).compile().as_text()
    jax.block_until_ready(step(*args))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            jax.block_until_ready(step(*args))
    measured = scheduling.read_trace(tmp_path)

    costs = traced_costs(result.graph, measured, hlo_text, estimate, {"x": 8})

    traced = sum(measured.seconds.values())
    assert costs.callbacks_s == 0.0  # XLA's all-to-alls here: no transport callbacks
    assert costs.between_ops_s == pytest.approx(max(0.0, measured.step_seconds - traced))
    in_ops = sum(costs.compute.values()) - costs.between_ops_s
    assert in_ops + costs.xla_collectives_s == pytest.approx(traced)
    assert sum(costs.host.values()) == pytest.approx(costs.xla_collectives_s)
    for layer in ("jvp(layer_0)", "jvp(layer_1)", "transpose(jvp(layer_1))"):
        assert sum(costs.compute.get(n.id, 0) for n in _nodes(result.graph, "dot_general", layer))
    for node in result.graph.nodes:  # host work only on a collective's start (or itself)
        assert node.id not in costs.host or (node.is_collective and node.role is not Role.DONE)
    # The simulator's seconds: traced compute, the link's for collectives, none for a done.
    seconds = costs.seconds(lambda node: 7.0)
    for node in result.graph.nodes:
        expected = costs.compute.get(node.id, 0.0)
        if node.is_collective:
            expected = 0.0 if node.role is Role.DONE else 7.0
        assert seconds(node) == expected


def _line(name: str, op_name: str) -> str:
    return f'  %{name} = f32[] custom-call(%x), metadata={{op_name="jit(run)/shard_map/{op_name}"}}'


def _socket_trace():
    hlo_text = "\n".join(
        [
            "ENTRY %main (x: f32[]) -> f32[] {",
            "  %x = f32[] parameter(0)",
            _line("custom-call.1", "jvp(layer_0)/socket_start/host_callback"),
            _line("custom-call.2", "jvp(layer_0)/socket_done/host_callback"),
            _line("fusion.3", "jvp(layer_0)/dot_general"),
            _line("all-reduce.4", "grad/psum"),
            "}",
        ]
    )
    seconds = {
        "custom-call.1": 0.002,
        "custom-call.2": 0.010,
        "fusion.3": 0.1,
        "all-reduce.4": 0.05,
        "copy.5": 0.01,  # named in no metadata: spread over the computation
    }
    return MeasuredOps("jit_run", 1, 1, seconds, 0.192), hlo_text  # 0.02 s between ops


def test_socket_callbacks_are_the_host_work_of_their_all_to_all(scheduled):
    result, estimate = scheduled
    graph = result.graph
    measured, hlo_text = _socket_trace()

    costs = traced_costs(graph, measured, hlo_text, estimate, {"x": 8}, SCOPES)

    (start,) = _nodes(graph, "all_to_all", "jvp(layer_0)", Role.START)
    assert costs.host[start.id] == pytest.approx(0.002)
    assert costs.host[start.partner] == pytest.approx(0.010)
    assert (costs.callbacks_s, costs.xla_collectives_s, costs.unattributed_s) == (0.012, 0.05, 0.01)
    dots = _nodes(graph, "dot_general", "jvp(layer_0)")
    assert costs.between_ops_s == pytest.approx(0.02)
    assert sum(costs.compute[n.id] for n in dots) == pytest.approx(0.13)
    assert sum(costs.compute.values()) == pytest.approx(0.13)
    # XLA's collective time goes to the other collectives, by the bytes they put on the wire.
    xla = {n: s for n, s in costs.host.items() if n not in (start.id, start.partner)}
    assert sum(xla.values()) == pytest.approx(0.05)
    (other,) = _nodes(graph, "all_to_all", "jvp(layer_1)", Role.START)
    assert other.id in xla


def test_an_unsplit_all_to_all_takes_both_callbacks(captured):
    # Under ``none`` the socket all-to-all is started and waited for at once.
    program, cost = captured
    policy = scheduling.SchedulePolicy(name="none", profile=scheduling.PROFILES["cpu"])
    graph = scheduling.schedule(program, policy, cost).graph
    measured, hlo_text = _socket_trace()

    costs = traced_costs(graph, measured, hlo_text, node_seconds(cost), {"x": 8}, SCOPES)

    (node,) = _nodes(graph, "all_to_all", "jvp(layer_0)")
    assert node.is_collective and node.partner is None
    assert costs.host[node.id] == pytest.approx(0.012)
    assert sum(costs.host.values()) == pytest.approx(0.012 + 0.05)
