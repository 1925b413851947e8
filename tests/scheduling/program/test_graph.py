"""graph: start/done splitting, topological ids, reachability, dW classification, effects."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.passes import split_async
from scheduling.program import jax_adapter
from scheduling.program.capture import Phase, capture
from scheduling.program.graph import Graph, Kind, Role
from tests.scheduling.toys import (
    brute_ancestors,
    mesh_2x4,
    mesh_x,
    node_of_op,
    producer_ops,
    sds,
    toy_program,
)


@pytest.fixture(scope="module", params=[False, True], ids=["toy", "toy_reg"])
def program(request):
    return toy_program(request.param)


def test_split_async_makes_one_start_and_one_done_per_collective(program):
    graph = split_async(program)
    for op in program.collectives():
        nodes = [n for n in graph.nodes if n.op is op]
        assert sorted(n.role.value for n in nodes) == ["done", "start"]
        start, done = sorted(nodes, key=lambda n: n.role is Role.DONE)
        assert start.partner == done.id
        assert done.partner == start.id
        assert graph.preds[done.id] == {start.id}
        assert graph.succs[start.id] == {done.id}
        assert done.id == start.id + 1
    for op in program.ops:
        if not op.is_collective:
            (node,) = [n for n in graph.nodes if n.op is op]
            assert node.role is Role.COMPUTE
    assert len(graph.nodes) == len(program.ops) + len(program.collectives())


def test_graph_without_split_keeps_collectives_as_single_nodes(program):
    graph = Graph(program, split=lambda op: False)
    assert len(graph.nodes) == len(program.ops)
    assert all(n.role is Role.COMPUTE and n.partner is None for n in graph.nodes)
    assert graph.starts() == []
    assert graph.backward_all_to_alls() == []
    collective_nodes = [n for n in graph.nodes if n.is_collective]
    assert [n.op for n in collective_nodes] == program.collectives()
    assert all(graph.kinds[n.id] is Kind.COLLECTIVE for n in collective_nodes)


def test_split_async_kinds_restricts_which_collectives_split(program):
    graph = split_async(program, kinds=["all_to_all"])
    split_ops = {n.op.primitive for n in graph.starts()}
    assert split_ops == {"all_to_all"}
    psums = [n for n in graph.nodes if n.op.primitive == "psum"]
    assert psums and all(n.role is Role.COMPUTE for n in psums)


def test_a_collective_over_axes_of_size_1_is_not_split():
    mesh = jax.make_mesh((1, 8), ("data", "expert"))

    def step(x):
        summed = jax.lax.psum(x, "data")  # one device per group: the identity
        return jax.lax.psum(summed, ("data", "expert"))

    spec = P(("data", "expert"))
    program = capture(step, sds(mesh, (64, 4), spec), mesh=mesh, in_specs=(spec,), out_specs=P())
    graph = split_async(program)
    assert [n.op.eqn.params["axes"] for n in graph.starts()] == [("data", "expert")]
    assert [n.role for n in graph.nodes if n.op.eqn.params.get("axes") == ("data",)] == [
        Role.COMPUTE
    ]


def test_node_ids_are_a_topological_order(program):
    graph = split_async(program)
    for node in graph.nodes:
        assert all(pred < node.id for pred in graph.preds[node.id])
        assert all(succ > node.id for succ in graph.succs[node.id])
        for pred in graph.preds[node.id]:
            assert node.id in graph.succs[pred]


def test_reachability_agrees_with_brute_force_dfs(program):
    graph = split_async(program)
    size = len(graph.nodes)
    ancestors = [brute_ancestors(graph, n) for n in range(size)]
    for node in range(size):
        assert set(graph.members(graph.ancestors[node])) == ancestors[node]
        descendants = {m for m in range(size) if node in ancestors[m]}
        assert set(graph.members(graph.descendants[node])) == descendants
        for other in range(size):
            assert graph.has_path(other, node) == (other in ancestors[node])
            expected_independent = (
                other != node and other not in ancestors[node] and node not in ancestors[other]
            )
            assert graph.independent(node, other) == expected_independent


def _w2_gradient_dot(program):
    """The backward dot_general computing W2's gradient, traced back from W2's update."""
    producers = producer_ops(program)
    frontier = [producers[program.outputs[1]]]
    while frontier:
        op = frontier.pop()
        if op.primitive == "dot_general" and op.phase is Phase.BACKWARD:
            return op
        frontier.extend(producers[a] for a in op.inputs if a in producers)
    raise AssertionError("no dot_general found upstream of W2's update")


def _backward_a2a_start(graph, layer):
    (start,) = [n for n in graph.backward_all_to_alls() if n.op.layer == layer]
    return start


def test_w2_gradient_is_dw_for_the_layer_0_backward_all_to_all(program):
    graph = split_async(program)
    assert [n.op.layer for n in graph.backward_all_to_alls()] == ["layer_1", "layer_0"]
    dw2 = _w2_gradient_dot(program)
    assert dw2.layer == "layer_1"
    node = node_of_op(graph, dw2)
    assert graph.kinds[node] is Kind.BACKWARD_DW
    layer_0 = _backward_a2a_start(graph, "layer_0")
    layer_1 = _backward_a2a_start(graph, "layer_1")
    assert graph.dw_candidates(layer_0) >> node & 1
    # It needs the layer_1 backward all_to_all's result: not a candidate for that one.
    assert not graph.dw_candidates(layer_1) >> node & 1
    assert graph.has_path(layer_1.partner, node)


def test_activation_gradient_chain_is_not_a_candidate_for_the_all_to_all_it_feeds(program):
    graph = split_async(program)
    layer_0 = _backward_a2a_start(graph, "layer_0")
    # The op producing the layer_0 all_to_all's operand is the dX dot_general.
    (feeder,) = graph.preds[layer_0.id]
    assert graph.nodes[feeder].op.primitive == "dot_general"
    assert graph.kinds[feeder] is Kind.BACKWARD_DX
    for start in graph.backward_all_to_alls():
        candidates = set(graph.members(graph.dw_candidates(start)))
        related = brute_ancestors(graph, start.id) | {start.id, start.partner}
        related |= {
            m for m in range(len(graph.nodes)) if start.partner in brute_ancestors(graph, m)
        }
        assert not candidates & related
        for node in candidates:
            assert graph.nodes[node].role is Role.COMPUTE
            assert graph.nodes[node].op.phase is Phase.BACKWARD
            assert not graph.nodes[node].is_collective
            assert graph.independent(node, start.id)
            assert graph.independent(node, start.partner)


def test_no_optimizer_or_forward_node_is_ever_a_candidate(program):
    graph = split_async(program)
    assert graph.backward_all_to_alls()
    non_backward = {n.id for n in graph.nodes if n.op.phase is not Phase.BACKWARD}
    assert any(graph.kinds[n] is Kind.OPTIMIZER for n in non_backward)
    for start in graph.backward_all_to_alls():
        assert not set(graph.members(graph.dw_candidates(start))) & non_backward


def test_kinds_partition_backward_nodes_by_candidacy(program):
    graph = split_async(program)
    candidates = set()
    for start in graph.backward_all_to_alls():
        candidates |= set(graph.members(graph.dw_candidates(start)))
    for node in graph.nodes:
        kind = graph.kinds[node.id]
        if node.is_collective:
            assert kind is Kind.COLLECTIVE
        elif node.op.phase is Phase.BACKWARD:
            assert (kind is Kind.BACKWARD_DW) == (node.id in candidates)
            assert kind in (Kind.BACKWARD_DW, Kind.BACKWARD_DX)
        else:
            assert kind.value == node.op.phase.value


def _two_psums(x):
    a = jax.lax.psum(x, "x")
    b = jax.lax.psum(x * 2.0, "x")
    return a, b


@pytest.mark.parametrize("split", [False, True], ids=["sync", "async"])
def test_collectives_are_not_chained_by_their_effects(split):
    mesh = mesh_x()
    program = capture(
        _two_psums, sds(mesh, (8, 4), P()), mesh=mesh, in_specs=P(), out_specs=(P(), P())
    )
    first, second = program.collectives()
    assert first.eqn.effects  # NamedAxisEffects are there...
    assert not jax_adapter.has_ordered_effect(first.eqn)  # ...but unordered
    graph = split_async(program) if split else Graph(program, split=lambda op: False)
    a = min(n.id for n in graph.nodes if n.op is first)
    b = min(n.id for n in graph.nodes if n.op is second)
    assert graph.independent(a, b)
    if split:
        assert graph.independent(graph.nodes[a].partner, graph.nodes[b].partner)


def test_collectives_over_different_axes_are_independent_on_2d_mesh():
    mesh = mesh_2x4()

    def step(x):
        return jax.lax.psum(x, "data"), jax.lax.all_to_all(x, "expert", 0, 0, tiled=True)

    program = capture(step, sds(mesh, (16, 4), P()), mesh=mesh, in_specs=P(), out_specs=(P(), P()))
    graph = split_async(program)
    psum, a2a = graph.starts()
    assert {psum.op.primitive, a2a.op.primitive} == {"psum", "all_to_all"}
    assert graph.independent(psum.id, a2a.id)


def test_ordered_effects_keep_program_order_but_collectives_do_not():
    mesh = mesh_x()

    def step(x):
        jax.debug.print("first {}", x[0, 0], ordered=True)
        y = x * 2.0
        jax.debug.print("second {}", y[0, 0], ordered=True)
        return jax.lax.psum(y, "x")

    program = capture(step, sds(mesh, (8, 4), P()), mesh=mesh, in_specs=P(), out_specs=P())
    graph = Graph(program, split=lambda op: False)
    prints = [n.id for n in graph.nodes if n.op.primitive == "debug_print"]
    assert len(prints) == 2
    assert all(jax_adapter.has_ordered_effect(graph.nodes[n].op.eqn) for n in prints)
    assert prints[0] in graph.preds[prints[1]]  # chained although no data flows between them
    (psum,) = [n.id for n in graph.nodes if n.op.is_collective]
    assert graph.independent(psum, prints[1])
