"""A toy expert layer for the exchange-decomposition tests (no jaxmoe).

Each device holds ``G * SLOTS`` tokens of width ``D``; a dense layer makes them, in
expert-major slots ``[G, SLOTS, D]`` (block ``j`` for device ``j``). The layer exchanges
them over the expert axis, applies this device's expert (a ReLU MLP), sends them
back and adds the result to the tokens; the loss sums squares. A variant puts a
mean over the received tokens of every source in between, which mixes sources and
cannot be decomposed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from scheduling.program.capture import Program, capture
from tests.scheduling.toys import mesh_2x4, mesh_x, put, sds

D, H = 8, 16  # width, expert hidden size
SLOTS = 8  # slots per source device and expert
LR = 0.01


def expert_layer(params, tokens, axis: str, mix_sources: bool = False):
    """``tokens [G * SLOTS, D]`` through exchange, expert, exchange back."""
    w_before, w_in, b_in, w_out = params
    group = jax.lax.axis_size(axis)
    with jax.named_scope("layer_0/before"):
        tokens = tokens @ w_before  # so that the backward pass exchanges both ways
    with jax.named_scope("layer_0/moe"):
        sent = tokens.reshape(group, SLOTS, D)
        received = jax.lax.all_to_all(sent, axis, 0, 0, tiled=False)  # [G, SLOTS, D]
        if mix_sources:  # a statistic over every source's tokens: sources are not separable
            received = received - jnp.mean(received, axis=0, keepdims=True)
        rows = received.reshape(group * SLOTS, D)
        hidden = jax.nn.relu(rows @ w_in + b_in)
        out = (hidden @ w_out).reshape(group, SLOTS, D)
        back = jax.lax.all_to_all(out, axis, 0, 0, tiled=False)
    return tokens + back.reshape(group * SLOTS, D)


def make_step(axis: str, mix_sources: bool = False, axes: tuple[str, ...] | None = None):
    axes = axes or (axis,)

    def step(params, tokens):
        def loss(params):
            y = expert_layer(params, tokens, axis, mix_sources)
            return jnp.sum(y * y)

        value, grads = jax.value_and_grad(loss)(params)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, axes), grads)
        new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return new, jax.lax.psum(value, axes)

    return step


IN_SPECS = ((P(),) * 4, P("x"))
OUT_SPECS = ((P(),) * 4, P())
IN_SPECS_2X4 = ((P(),) * 4, P(("data", "expert")))


def _param_shapes():
    return ((D, D), (D, H), (H,), (H, D))


def args(mesh=None, token_spec=None):
    mesh = mesh or mesh_x()
    token_spec = token_spec or P("x")
    rng = np.random.default_rng(0)
    params = tuple(
        put(mesh, jnp.asarray(_halves(rng, shape), jnp.float32), P()) for shape in _param_shapes()
    )
    devices = mesh.devices.size
    group = mesh.shape.get("x", mesh.shape.get("expert"))
    tokens = _halves(rng, (devices * group * SLOTS, D))
    return params, put(mesh, jnp.asarray(tokens, jnp.float32), token_spec)


def _halves(rng, shape):
    """Multiples of 1/2 in [-1, 1]: every product and sum of the step is exact in float32,
    so the result does not depend on the order a CPU's matmul kernels sum in (XLA:CPU's
    kernels sum a product of 8 rows and one of 64 in different orders on some CPUs)."""
    return rng.integers(-2, 3, shape) / 2


def shapes(mesh=None, token_spec=None):
    mesh = mesh or mesh_x()
    token_spec = token_spec or P("x")
    group = mesh.shape.get("x", mesh.shape.get("expert"))
    params = tuple(sds(mesh, shape, P()) for shape in _param_shapes())
    return params, sds(mesh, (mesh.devices.size * group * SLOTS, D), token_spec)


@functools.cache
def program(mix_sources: bool = False) -> Program:
    return capture(
        make_step("x", mix_sources),
        *shapes(),
        mesh=mesh_x(),
        in_specs=IN_SPECS,
        out_specs=OUT_SPECS,
    )


@functools.cache
def program_2x4() -> Program:
    return capture(
        make_step("expert", axes=("data", "expert")),
        *shapes(mesh_2x4(), P(("data", "expert"))),
        mesh=mesh_2x4(),
        in_specs=IN_SPECS_2X4,
        out_specs=OUT_SPECS,
    )
