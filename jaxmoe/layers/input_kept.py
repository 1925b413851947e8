"""Functions that keep only their inputs for the backward pass, and compute the rest again
there (the activations of :mod:`jaxmoe.layers.activations`, the norms of
:mod:`jaxmoe.layers.norms`).

Differentiated as written, an elementwise function or a norm keeps its intermediates
until the backward pass: SwiGLU its gate, its up projection, a sigmoid and a silu; a norm
of a bfloat16 input the input again in float32, its statistics and the normalised
values. :func:`keeping_inputs` makes a function a ``jax.custom_vjp`` whose residuals are
its arguments alone, and whose backward pass runs it again from them before taking JAX's
own derivative (Megatron-Core's fused SwiGLU keeps its input alike, and its fused norms
their input and each row's statistics). The values and the derivatives are JAX's: only
what is kept between the passes changes.

An ``optimization_barrier`` ties the recomputation to the incoming gradient: without it
XLA would merge it with the forward pass's identical ops and keep their results after
all (as ``jax.checkpoint``'s ``prevent_cse`` does for a recomputed block).

A block that is itself recomputed (``model.recompute`` in
:data:`jaxmoe.layers.recompute.POLICIES`) makes these values again in its backward pass
anyway; there the functions run as written (:func:`kept_inputs`), so that nothing is
computed a third time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxmoe.layers.recompute import POLICIES


def keeping_inputs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a ``custom_vjp`` that keeps its arguments alone (module docstring). Every
    argument is differentiated: pass what is not an array in a closure."""

    @jax.custom_vjp
    def apply(*args: Any) -> Any:
        return fn(*args)

    def forward(*args: Any) -> tuple[Any, tuple[Any, ...]]:
        return fn(*args), args

    def backward(args: tuple[Any, ...], d_out: Any) -> tuple[Any, ...]:
        args, d_out = jax.lax.optimization_barrier((args, d_out))
        _, derivative = jax.vjp(fn, *args)
        return derivative(d_out)

    apply.defvjp(forward, backward)
    return apply


def kept_inputs(recompute: str) -> bool:
    """Whether a block recomputed as ``recompute`` says (``model.recompute``) keeps the
    inputs alone of its activations and norms: where it keeps its forward values."""
    return recompute not in POLICIES
