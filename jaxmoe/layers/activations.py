"""The feed-forward activations (``model.activation``), keeping only their input for the
backward pass where the block's forward values are kept.

Differentiated as written, ``silu(gate) * up`` keeps ``gate``, ``up``, ``sigmoid(gate)``
and ``silu(gate)`` until the backward pass (four ``[tokens, d_ff]`` tensors per expert
or MLP), and the tanh form of ``gelu`` its input and its intermediates. Here each
activation is a ``jax.custom_vjp`` whose residual is its input alone (the gate and up
projections as the one fused GEMM made them), and whose backward pass computes the
activation again from it, elementwise, before taking JAX's own derivative of it
(Megatron-Core's fused SwiGLU keeps its input alike). The values and the derivatives
are JAX's: only what is kept between the passes changes.

An ``optimization_barrier`` ties the recomputation to the incoming gradient: without it
XLA would merge it with the forward pass's identical ops and keep their results after all
(as ``jax.checkpoint``'s ``prevent_cse`` does for a recomputed block).

A block that is itself recomputed (``model.recompute`` ``matmuls``, ``matmuls_offload``,
``layer``: :data:`jaxmoe.layers.recompute.POLICIES`) makes the activation's values again
in its backward pass anyway; there the activation runs as written (:func:`activate`), so
that nothing is computed a third time.
"""

from __future__ import annotations

import jax

from jaxmoe.layers.recompute import POLICIES

# The name scope of an activation's ops (the planner's bounds read it).
SCOPE = "activation"


def _swiglu(gate_up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]


def _recomputed(activation):
    """``activation`` as a ``custom_vjp`` that keeps its input alone (module docstring)."""

    @jax.custom_vjp
    def apply(x: jax.Array) -> jax.Array:
        return activation(x)

    def forward(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return activation(x), x

    def backward(x: jax.Array, d_out: jax.Array) -> tuple[jax.Array]:
        x, d_out = jax.lax.optimization_barrier((x, d_out))
        _, derivative = jax.vjp(activation, x)
        return derivative(d_out)

    apply.defvjp(forward, backward)
    return apply


swiglu = _recomputed(_swiglu)
swiglu.__doc__ = """``silu(gate) * up`` of ``gate_up [..., 2, d_ff]`` (gate and up stacked on
the second-to-last axis, as one GEMM makes them): ``[..., d_ff]``."""

gelu = _recomputed(jax.nn.gelu)
gelu.__doc__ = """``jax.nn.gelu`` (the tanh approximation), keeping its input alone."""


_AS_WRITTEN = {"swiglu": _swiglu, "gelu": jax.nn.gelu}
_INPUT_KEPT = {"swiglu": swiglu, "gelu": gelu}


def activate(activation: str, x: jax.Array, recompute: str) -> jax.Array:
    """``activation`` (``model.activation``) of ``x`` in a block recomputed as ``recompute``
    says (``model.recompute``): keeping its input alone, or as written where the block is
    recomputed (module docstring)."""
    forms = _AS_WRITTEN if recompute in POLICIES else _INPUT_KEPT
    with jax.named_scope(SCOPE):
        return forms[activation](x)
