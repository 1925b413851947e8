"""The feed-forward activations (``model.activation``): SwiGLU and GELU, keeping only their
input for the backward pass where the block's forward values are kept
(:mod:`jaxmoe.layers.input_kept`).

Differentiated as written, ``silu(gate) * up`` keeps ``gate``, ``up``, ``sigmoid(gate)``
and ``silu(gate)`` until the backward pass (four ``[tokens, d_ff]`` tensors per expert
or MLP), and the tanh form of ``gelu`` its input and its intermediates. Kept as their
input alone, they keep the fused gate/up GEMM's result (Megatron-Core's fused SwiGLU
keeps its input alike), and their backward pass computes them again from it. In a block
that is itself recomputed they run as written.
"""

from __future__ import annotations

import jax

from jaxmoe.layers.input_kept import keeping_inputs, kept_inputs

# The name scope of an activation's ops (the planner's bounds read it).
SCOPE = "activation"


def _swiglu(gate_up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]


swiglu = keeping_inputs(_swiglu)
swiglu.__doc__ = """``silu(gate) * up`` of ``gate_up [..., 2, d_ff]`` (gate and up stacked on
the second-to-last axis, as one GEMM makes them): ``[..., d_ff]``."""

gelu = keeping_inputs(jax.nn.gelu)
gelu.__doc__ = """``jax.nn.gelu`` (the tanh approximation), keeping its input alone."""


_AS_WRITTEN = {"swiglu": _swiglu, "gelu": jax.nn.gelu}
_INPUT_KEPT = {"swiglu": swiglu, "gelu": gelu}


def activate(activation: str, x: jax.Array, recompute: str) -> jax.Array:
    """``activation`` (``model.activation``) of ``x`` in a block recomputed as ``recompute``
    says (``model.recompute``): keeping its input alone, or as written where the block is
    recomputed (:func:`~jaxmoe.layers.input_kept.kept_inputs`)."""
    forms = _INPUT_KEPT if kept_inputs(recompute) else _AS_WRITTEN
    with jax.named_scope(SCOPE):
        return forms[activation](x)
