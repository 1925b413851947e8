"""Toy per-device steps for the forward-partition tests (no jaxmoe).

Each device holds ``BATCH`` examples of ``TOKENS`` tokens of width ``D``. A
"layer" computes on the tokens, exchanges them with an ``all_to_all`` over
the ``x`` axis (split along the token axis, never the batch), computes again
and sends them back; the loss sums squares over the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from scheduling.program.capture import capture
from tests.scheduling.toys import N, mesh_x, put, sds

BATCH = 8  # examples per device
TOKENS = 2 * N
D = 4
LR = 0.01
IN_SPECS = ((P(),) * 3, P("x"))
OUT_SPECS = ((P(),) * 3, P())


def exchange(h: jax.Array) -> jax.Array:
    """``[B, TOKENS, D] -> [N, B, TOKENS / N, D]``, then all_to_all over ``x``."""
    parts = h.reshape(h.shape[0], N, TOKENS // N, D).transpose(1, 0, 2, 3)
    return jax.lax.all_to_all(parts, "x", 0, 0, tiled=False)


def exchange_back(h: jax.Array) -> jax.Array:
    back = jax.lax.all_to_all(h, "x", 0, 0, tiled=False)
    return back.transpose(1, 0, 2, 3).reshape(back.shape[1], TOKENS, D)


def pipelined_loss(params, x):
    """matmul -> all_to_all -> matmul, then a reduction over the batch."""
    w1, w2, _ = params
    with jax.named_scope("layer_0/before"):
        h = x @ w1
    with jax.named_scope("layer_0/moe"):
        h = exchange(h) @ w2
    return jnp.sum(h * h)


def loss_with_batch_statistic(params, x):
    """A reduction over the batch in the middle: what follows needs every chunk."""
    w1, w2, w3 = params
    with jax.named_scope("layer_0/moe"):
        h = jnp.tanh(exchange(x @ w1) @ w2)
    with jax.named_scope("layer_0/statistic"):
        mean = jnp.mean(h, axis=1, keepdims=True)  # over the batch axis
    with jax.named_scope("layer_0/centred"):
        h = h - mean
    with jax.named_scope("layer_1/moe"):
        h = exchange_back(jnp.tanh(h @ w3))
    with jax.named_scope("layer_1/after"):
        h = jnp.cumsum(h, axis=1) @ w1  # a prefix along tokens, inside a chunk
    return jnp.sum(h * h)


def prefix_over_batch_loss(params, x):
    """A prefix sum along the batch axis: chunks carry the running total."""
    w1, w2, _ = params
    with jax.named_scope("layer_0/moe"):
        h = exchange(jnp.tanh(x @ w1))
    with jax.named_scope("layer_0/prefix"):
        h = jnp.cumsum(h, axis=1) @ w2  # axis 1 of [N, B, ...] is the batch
    return jnp.sum(h * h)


TILES = 2  # tiles of the tokens that tiled_loss's loop visits


def tiled_loss(params, x):
    """A loop over tiles of the tokens before the exchange, as the blockwise attention's
    forward pass: each row's running maximum, and each tile written into the loop's output
    as it is visited (the carries start as a fill and zeros, not split; the loop splits
    them). The loop reads the examples, not the parameters, so nothing is differentiated
    through it."""
    w1, w2, _ = params
    with jax.named_scope("layer_0/tiled"):
        tiles = x.reshape(x.shape[0], TILES, TOKENS // TILES, D).transpose(1, 0, 2, 3)

        def visit(state, i):
            running, out = state
            tile = jax.lax.dynamic_index_in_dim(tiles, i, keepdims=False)  # [B, t, D]
            running = jnp.maximum(running, tile.max(axis=1))
            written = jnp.exp(tile - running[:, None])
            return (running, jax.lax.dynamic_update_index_in_dim(out, written, i, 0)), None

        init = (jnp.full((x.shape[0], D), -1e30), jnp.zeros_like(tiles))
        (running, out), _ = jax.lax.scan(visit, init, jnp.arange(TILES))
        h = jnp.tanh((out.transpose(1, 0, 2, 3).reshape(x.shape) * running[:, None]) @ w1)
    with jax.named_scope("layer_0/moe"):
        h = exchange(h) @ w2
    return jnp.sum(h * h)


def make_step(loss_fn):
    def step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, "x"), grads)
        new_params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return new_params, jax.lax.psum(loss, "x")

    return step


def args():
    mesh = mesh_x()
    rng = np.random.default_rng(0)
    params = tuple(
        put(mesh, jnp.asarray(rng.standard_normal((D, D)), jnp.float32) * 0.5, P())
        for _ in range(3)
    )
    x = put(mesh, jnp.asarray(rng.standard_normal((BATCH * N, TOKENS, D)), jnp.float32), P("x"))
    return params, x


def shapes():
    mesh = mesh_x()
    params = tuple(sds(mesh, (D, D), P()) for _ in range(3))
    return params, sds(mesh, (BATCH * N, TOKENS, D), P("x"))


def program(loss_fn):
    return capture(
        make_step(loss_fn), *shapes(), mesh=mesh_x(), in_specs=IN_SPECS, out_specs=OUT_SPECS
    )
