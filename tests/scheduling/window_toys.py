"""Synthetic backward passes for the dW packing and the list scheduler: forward-only
programs whose ops are all marked backward, so that each all_to_all is a dW window and
the work on ``w`` is a dW candidate.

Each step first reads ``w`` where the first window opens (:func:`_read`): the work on it
then reads a value the step computes, as dW work does (work on the step's inputs alone
is never placed by itself)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from scheduling.costs.cost_model import CostModel
from scheduling.passes import split_async
from scheduling.profiles import PROFILES
from scheduling.program.capture import capture
from scheduling.program.graph import Role
from tests.scheduling.toys import as_backward, mesh_x, sds


def a2a(v):
    return jax.lax.all_to_all(v, "x", 0, 0, tiled=True)


def _read(w, x):
    """``w`` as the step computes it, made before the first all_to_all."""
    w = w * 1.0
    return w, x + w.sum()


def two_window_step(w, x):
    w, x = _read(w, x)
    a = x * 2.0
    t1 = a2a(a)
    b = t1 * 3.0
    t2 = a2a(b)
    return (t2, *(w * c for c in (5.0, 7.0, 11.0, 13.0, 17.0)))


def chain_step(w, x):
    w, x = _read(w, x)
    t1 = a2a(x * 2.0)
    t2 = a2a(t1 * 3.0)
    c1 = w * 5.0
    c2 = c1 * 7.0
    return t2, c2


def forced_step(w, x):
    w, x = _read(w, x)
    t1 = a2a(x * 2.0)
    n1 = w * 5.0  # needed by the second all_to_all: its last window is the first
    n2 = w * 7.0
    b = (t1 + n1) + n2
    t2 = a2a(b)
    free = w * 11.0  # a candidate of both windows
    return t2, free


def late_dw_step(w, x):
    w, x = _read(w, x)
    t1 = a2a(x * 2.0)
    t2 = a2a(t1 * 3.0)
    c = t2 * 5.0
    d = w * 7.0  # after everything in program order, a candidate of both windows
    return c, jax.lax.psum(d, "x")


def constant_step(w, x):
    w, x = _read(w, x)
    t1 = a2a(x * 2.0)
    t2 = a2a(t1 * 3.0)
    scale = jnp.full(w.shape, 5, jnp.int32).astype(w.dtype)  # made from a literal alone
    lone = jnp.full(w.shape, 7.0, w.dtype)  # the same, and read by nothing the step computes
    return t2, w * scale, lone


def memory_step(w, x):
    w, x = _read(w, x)
    t1 = a2a(x * 2.0)
    t2 = a2a(t1 * 3.0)
    s = t2.sum()
    big = w * 5.0
    return s + big.sum()


def window_graph(step, w_shape=(8, 4), x_shape=(64, 4)):
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


def two_windows(graph):
    starts = graph.backward_all_to_alls()
    assert len(starts) == 2
    return starts


def dw_candidates(graph, start):
    return graph.members(graph.dw_candidates(start))


def cost_model_seconds(graph):
    cost = CostModel(PROFILES["a100"], dict(graph.program.mesh.shape))
    return lambda node: 0.0 if node.role is Role.DONE else cost.seconds(node.op)
