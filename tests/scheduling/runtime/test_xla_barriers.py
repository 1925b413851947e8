"""Windows pinned by optimization barriers: what passes each barrier, where the traced
step puts them, that they change no result, and that only a step for GPU has them (the
mesh here is of CPUs: the tests that emit for a GPU say so)."""

from __future__ import annotations

import functools
import re

import chex
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import scheduling.runtime.pinning
from scheduling.order.list_scheduler import Order
from scheduling.program.graph import Role
from scheduling.runtime.emit import emit
from scheduling.runtime.pinning import OVERLAP_LIMIT_OPTION, most_in_flight
from scheduling.runtime.xla_barriers import window_pins
from tests.scheduling.toys import mesh_x, sds, split_window_toy


def _step(x, w):
    a = jax.lax.all_to_all(x * 2.0, "x", 0, 0, tiled=True)  # the window
    p = (x * 3.0) @ w  # scheduled inside: reads x and w from before the start
    q = p @ w  # inside too, and read after the done
    gradient_like = jax.lax.psum(x * 5.0, "x")  # only returned: deferrable
    return gradient_like, a @ w + q


@functools.cache
def _graph():
    return split_window_toy(_step)


def _scheduled():
    """The order with the window holding ``x * 3``, ``p`` and ``q``."""
    graph = _graph()
    nodes = graph.nodes
    a = next(n.id for n in nodes if n.role is Role.START)
    tripled = [n.id for n in nodes if n.op.primitive == "mul"][1]  # after x * 2
    p, q, _ = (n.id for n in nodes if n.op.primitive == "dot_general")
    members = [tripled, p, q]
    rest = [n.id for n in nodes if n.id not in (a, nodes[a].partner, *members)]
    before_start = [n for n in rest if n < a]
    order = [*before_start, a, *members, nodes[a].partner]
    order += [n for n in rest if n not in order]
    return graph, order, a, members, q


def _schedule(order):
    return Order(order, None, 0, 0, [])


@pytest.fixture
def for_gpu(monkeypatch):
    monkeypatch.setattr(scheduling.runtime.pinning, "target_platform", lambda mesh: "gpu")


def test_a_pin_passes_what_the_window_reads_and_what_it_leaves_for_later():
    graph, order, a, members, q = _scheduled()
    pins = window_pins(graph, order)
    assert list(pins) == [a]  # the deferrable psum's window is left free
    pin = pins[a]
    x, w = graph.program.inputs
    assert (pin.index, pin.members) == (0, tuple(members))
    assert set(pin.before) == {x, w}  # p's and q's inputs from inside are not passed
    assert pin.after == tuple(graph.nodes[q].op.outputs)  # p is read inside only


def _nested_step(x, w):
    a = jax.lax.all_to_all(x * 2.0, "x", 0, 0, tiled=True)  # the outer window
    b = jax.lax.all_to_all((x * 3.0) @ w, "x", 0, 0, tiled=True)  # opened inside it
    r = (x * 4.0) @ w  # inside both
    return jax.lax.psum(x * 5.0, "x"), a @ w + b + r


def test_what_the_window_leaves_for_a_collective_it_encloses_passes_its_done_barrier():
    # The product feeding the inner collective is read inside the outer window's span,
    # but by no member of it: without passing the outer done barrier it could be
    # computed after the outer collective is done, outside the window.
    graph = split_window_toy(_nested_step)
    nodes = graph.nodes
    outer, inner = (n.id for n in nodes if n.role is Role.START and n.id not in graph.deferrable)
    third, fourth = [n.id for n in nodes if n.op.primitive == "mul"][1:3]
    feed, product, _ = (n.id for n in nodes if n.op.primitive == "dot_general")
    window = [outer, third, feed, inner, fourth, product, nodes[outer].partner]
    rest = [n.id for n in nodes if n.id not in window and n.id != nodes[inner].partner]
    order = [*(n for n in rest if n < outer), *window, nodes[inner].partner]
    order += [n for n in rest if n not in order]
    pins = window_pins(graph, order)
    assert pins[outer].members == (third, feed, fourth, product)
    assert set(pins[outer].after) == {*nodes[feed].op.outputs, *nodes[product].op.outputs}
    assert most_in_flight(graph, order) == 2


def test_the_pinned_step_is_compiled_with_as_many_collectives_in_flight_as_the_schedule(for_gpu):
    graph, order, *_ = _scheduled()
    assert emit(graph, _schedule(order)).pinned.compiler_options() == {OVERLAP_LIMIT_OPTION: 1}
    assert emit(graph, _schedule(order), xla_pin="none").pinned.compiler_options() == {}


def test_no_pin_for_a_window_with_nothing_inside():
    graph = _graph()
    assert window_pins(graph, list(range(len(graph.nodes)))) == {}


def _body(jaxpr):
    """The per-device equations inside the step's jit and shard_map."""
    while len(jaxpr.eqns) == 1 and "jaxpr" in jaxpr.eqns[0].params:
        inner = jaxpr.eqns[0].params["jaxpr"]
        jaxpr = getattr(inner, "jaxpr", inner)
    return jaxpr


def test_the_barriers_bound_the_window_in_the_traced_step(for_gpu):
    graph, order, *_ = _scheduled()
    step = emit(graph, _schedule(order), xla_pin="barriers")
    mesh = mesh_x()
    args = (sds(mesh, (64, 64), P("x")), sds(mesh, (64, 64), P()))
    body = _body(jax.make_jaxpr(step._jitted)(*args).jaxpr)
    names = [e.primitive.name for e in body.eqns]
    assert names.count("optimization_barrier") == 2
    first, second = (e for e in body.eqns if e.primitive.name == "optimization_barrier")
    start = next(e for e in body.eqns if e.primitive.name.endswith("_start"))
    done = next(e for e in body.eqns if e.primitive.name.endswith("_done"))
    readers = {id(v): [e for e in body.eqns if v in e.invars] for v in first.outvars}
    # The collective's operand passes the first barrier, and the window reads only what
    # passed it: x (for x * 3) and w (for both products).
    assert start.invars[0] is first.outvars[0]
    dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
    x, w = body.invars
    assert all(w not in e.invars for e in dots[:2]) and not any(x in e.invars for e in dots)
    assert all(readers[id(v)] for v in first.outvars[1:])
    # The result passes the second barrier with q, and everything after reads from it.
    assert second.invars[0] is done.outvars[0]
    later = body.eqns[body.eqns.index(second) + 1 :]
    assert all(v not in e.invars for e in later for v in second.invars)
    assert dots[2].invars[0] is second.outvars[0]  # a @ w
    # XLA:GPU keeps the start's and done's op_name, not their frontend attributes: their
    # name stack names the window, as the attribute does.
    text = step.lower(*args).as_text(debug_info=True)
    for half in ("start", "done"):
        (line,) = [line for line in text.splitlines() if f'@"all-to-all-{half}"' in line]
        location = re.search(r"loc\(#(\w+)\)", line).group(1)
        named = rf'#{location} = loc\("(?:[^"]*/)?_scheduled_window=0/all_to_all_{half}"'
        assert re.search(named, text)


def test_pinned_and_free_steps_compute_the_same_bits(for_gpu):
    graph, order, *_ = _scheduled()
    mesh = mesh_x()
    x = jax.device_put(
        np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32),
        jax.NamedSharding(mesh, P("x")),
    )
    w = jax.device_put(
        np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32) / 8,
        jax.NamedSharding(mesh, P()),
    )

    def op_seconds(op):
        return 1e-3 if op.is_collective else 1e-5

    pinned = emit(graph, _schedule(order), xla_pin="barriers", op_seconds=op_seconds)
    free = emit(graph, _schedule(order), xla_pin="none", op_seconds=op_seconds)
    # Both mark the window; only the pinned step holds it, its collective told the whole
    # step's serial time (one window: one serial step), longer than the collective and
    # the computation beside it.
    assert pinned.pinned.windows == free.pinned.windows == 1
    serial = sum(op_seconds(node.op) for node in graph.nodes if node.role is not Role.DONE)
    assert (len(pinned.pinned.pins), pinned.pinned.seconds) == (1, {0: pytest.approx(serial)})
    (pin,) = pinned.pinned.pins.values()
    assert serial > 1e-3 + 1e-5 * len(pin.members)
    assert (free.pinned.pins, free.pinned.seconds) == ({}, {})
    chex.assert_trees_all_equal(pinned(x, w), free(x, w))


def test_a_step_for_cpus_is_neither_pinned_nor_marked():
    graph, order, *_ = _scheduled()
    step = emit(graph, _schedule(order), xla_pin="barriers", op_seconds=lambda op: 1.0)
    assert step.pinned.windows == 0 and not step.pinned.pins and not step.pinned.seconds
    mesh = mesh_x()
    args = (sds(mesh, (64, 64), P("x")), sds(mesh, (64, 64), P()))
    assert "optimization_barrier" not in step.lower(*args).as_text()
