"""Scheduling groups as XLA:GPU accepts them: a window's start, done and the matrix
products placed in it that no path joins; no two groups reaching each other both ways;
no group for a window without a product, nor for a deferrable collective."""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from scheduling.passes import split_async
from scheduling.program.capture import capture
from scheduling.program.graph import Role
from scheduling.runtime.xla_groups import scheduling_groups, window_nodes
from tests.scheduling.toys import mesh_x, sds, split_window_toy


def _step(x, w):
    a = jax.lax.all_to_all(x, "x", 0, 0, tiled=True)  # window 1
    p1 = x @ w  # two independent products ...
    p2 = (x * 2.0) @ w
    chained = p1 @ w  # ... and one that needs the first through a product
    b = jax.lax.all_to_all(p2, "x", 0, 0, tiled=True)  # window 2: needs p2
    late = (x * 3.0) @ w
    gradient_like = jax.lax.psum(x * 5.0, "x")  # only returned: deferrable
    return gradient_like, a + chained + b + late


@functools.cache
def _graph():
    return split_window_toy(_step)


def _ids():
    graph = _graph()
    starts = [n.id for n in graph.nodes if n.role is Role.START]
    dots = [n.id for n in graph.nodes if n.op.primitive == "dot_general"]
    return graph, starts, dots


def _with_window(graph, start, inside):
    """Program order with ``inside`` moved between ``start`` and its done."""
    done = graph.nodes[start].partner
    order = [n for n in range(len(graph.nodes)) if n not in inside and n != done]
    at = order.index(start) + 1
    return [*order[:at], *inside, done, *order[at:]]


def test_a_group_holds_the_windows_independent_products_and_no_chained_one():
    graph, (a, _, _), (p1, p2, chained, _) = _ids()
    order = _with_window(graph, a, [p1, p2, chained])
    assert window_nodes(graph, order)[a] == [p1, p2, chained]
    groups = scheduling_groups(graph, order)
    group = {node for node, g in groups.items() if g == groups[a]}
    # p1 -> chained is a join: the group holds one of the two only.
    assert group & {p1, chained} and not {p1, chained} <= group
    assert {a, graph.nodes[a].partner, p2} <= group


def test_no_group_for_a_window_without_a_product_or_a_deferrable_collective():
    graph, (a, _, psum), (*_, late) = _ids()
    assert psum in graph.deferrable
    in_order = list(range(len(graph.nodes)))
    assert window_nodes(graph, in_order)[a] == []
    assert a not in scheduling_groups(graph, in_order)
    order = _with_window(graph, psum, [late])
    assert window_nodes(graph, order)[psum] == [late]
    groups = scheduling_groups(graph, order)
    assert psum not in groups and late not in groups


def _crossing_step(x, w, wide):
    u = x @ w
    a = jax.lax.all_to_all(x * 2.0, "x", 0, 0, tiled=True)
    b = jax.lax.all_to_all(u, "x", 0, 0, tiled=True)  # needs u
    s = (x * 3.0) @ w
    t = s @ wide  # needs s; more FLOPs than s
    return a, b, t


def test_groups_never_reach_each_other_both_ways():
    mesh = mesh_x()
    program = capture(
        _crossing_step,
        sds(mesh, (64, 64), P("x")),
        sds(mesh, (64, 64), P()),
        sds(mesh, (64, 128), P()),
        mesh=mesh,
        in_specs=(P("x"), P(), P()),
        out_specs=(P("x"), P("x"), P("x")),
    )
    graph = split_async(program)
    a, b = (n.id for n in graph.nodes if n.role is Role.START)
    u, s, t = (n.id for n in graph.nodes if n.op.primitive == "dot_general")
    a_done, b_done = graph.nodes[a].partner, graph.nodes[b].partner
    (scaled,) = graph.preds[a]  # x * 2.0
    (tripled,) = graph.preds[s]  # x * 3.0
    # Window a holds u, s and t; window b, opened inside it, holds s and t. Group a takes
    # u and t (t joins s); s would suit group b, but s -> t and u -> b: the two groups
    # would reach each other both ways.
    order = [scaled, a, u, b, tripled, s, t, a_done, b_done]
    assert sorted(order) == list(range(len(graph.nodes)))
    groups = scheduling_groups(graph, order)
    assert {groups[a], groups[u], groups[t]} == {groups[a_done]}
    assert s not in groups and b not in groups
    members: dict[int, set[int]] = {}
    for node, group in groups.items():
        members.setdefault(group, set()).add(node)
    for group, mine in members.items():
        for other, theirs in members.items():
            forward = any(graph.has_path(x, y) for x in mine for y in theirs)
            backward = any(graph.has_path(y, x) for x in mine for y in theirs)
            assert group == other or not (forward and backward)
