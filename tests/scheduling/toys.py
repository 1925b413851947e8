"""Toy per-device steps and helpers shared by the scheduling tests (no jaxmoe)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scheduling.program.capture import Phase, Program, capture
from scheduling.program.graph import Graph, Role

D = 4  # model width
N = 8  # devices on the 'x' axis
ROWS = 8  # tokens per device
LR = 0.01


def in_specs(reg=False):
    return ((P(),) * (3 if reg else 2), P("x"))


def out_specs(reg=False):
    return ((P(),) * (3 if reg else 2), P())


TOY_IN_SPECS = in_specs()
TOY_OUT_SPECS = out_specs()


@functools.cache
def mesh_x():
    return jax.make_mesh((N,), ("x",))


@functools.cache
def mesh_2x4():
    return jax.make_mesh((2, 4), ("data", "expert"))


def put(mesh, value, spec):
    return jax.device_put(value, NamedSharding(mesh, spec))


def sds(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def toy_loss(params, x, reg=False):
    """Two 'layers', each ending in an all_to_all over 'x'; optional W3 regulariser."""
    w1, w2 = params[:2]
    # The regulariser is computed first, so its gradient comes last in the backward pass.
    extra = jnp.sum(params[2] * params[2]) if reg else 0.0
    with jax.named_scope("layer_0"):
        h = jax.nn.relu(x @ w1)
        h = jax.lax.all_to_all(h.reshape(N, ROWS // N, D), "x", 0, 0, tiled=False)
    with jax.named_scope("layer_1"):
        h = h @ w2
        h = jax.lax.all_to_all(h, "x", 0, 0, tiled=False).reshape(ROWS, D)
    return jnp.sum(h**2) + extra


def make_toy_step(reg=False):
    def step(params, x):
        loss, grads = jax.value_and_grad(toy_loss)(params, x, reg)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, "x"), grads)
        new_params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return new_params, jax.lax.psum(loss, "x")

    return step


toy_step = make_toy_step(reg=False)
toy_step_reg = make_toy_step(reg=True)


def toy_args(reg=False, mesh=None):
    """Concrete arguments placed as ``in_specs(reg)`` says: ``(params, x)``."""
    mesh = mesh or mesh_x()
    rng = np.random.default_rng(0)
    params = tuple(
        put(mesh, jnp.asarray(rng.standard_normal((D, D)), jnp.float32) * 0.5, P())
        for _ in range(3 if reg else 2)
    )
    x = put(mesh, jnp.asarray(rng.standard_normal((ROWS * N, D)), jnp.float32), P("x"))
    return params, x


def toy_shapes(reg=False, mesh=None):
    mesh = mesh or mesh_x()
    params = tuple(sds(mesh, (D, D), P()) for _ in range(3 if reg else 2))
    return params, sds(mesh, (ROWS * N, D), P("x"))


@functools.cache
def toy_program(reg=False) -> Program:
    step = toy_step_reg if reg else toy_step
    return capture(
        step, *toy_shapes(reg), mesh=mesh_x(), in_specs=in_specs(reg), out_specs=out_specs(reg)
    )


def split_window_toy(step) -> Graph:
    """``step(x, w)`` (x of 64 x 64 split over 'x', w replicated; returning a replicated
    value and one split over 'x') captured, its collectives split into async pairs."""
    from scheduling.passes import split_async

    mesh = mesh_x()
    program = capture(
        step,
        sds(mesh, (64, 64), P("x")),
        sds(mesh, (64, 64), P()),
        mesh=mesh,
        in_specs=(P("x"), P()),
        out_specs=(P(), P("x")),
    )
    return split_async(program)


def reference(step, mesh, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


def as_backward(program: Program) -> Program:
    """Mark every op of a (forward-only) program as backward, to hand-build dW windows."""
    for op in program.ops:
        op.phase = Phase.BACKWARD
    return program


def producer_ops(program: Program):
    """``Value -> Op`` that produces it."""
    return {value: op for op in program.ops for value in op.outputs}


def node_of_op(graph: Graph, op, role=Role.COMPUTE) -> int:
    (node,) = (n.id for n in graph.nodes if n.op is op and n.role is role)
    return node


def brute_ancestors(graph: Graph, node: int) -> set[int]:
    seen: set[int] = set()
    stack = list(graph.preds[node])
    while stack:
        pred = stack.pop()
        if pred not in seen:
            seen.add(pred)
            stack.extend(graph.preds[pred])
    return seen


def fixed_seconds(costs: dict[int, float], default: float = 0.0):
    """A ``seconds(node)`` function from a dict of node id -> seconds."""
    return lambda node: costs.get(node.id, default)
