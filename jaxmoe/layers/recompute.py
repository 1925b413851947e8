"""Full-layer recomputation (``model.recompute="layer"``): each block's forward pass runs
again in the backward pass, from the block's input, instead of keeping its activations.

Every block is called through :func:`call_block`. Under ``"layer"`` the call runs under
``jax.checkpoint`` with JAX's default policy (nothing saved but the arguments) and
``prevent_cse``: the backward pass of block i runs block i's forward pass again, every
collective in it included (the expert all-to-alls and the tensor-parallel gathers and
reduce-scatters run once more per step, besides their transposes), then its transpose.
Between the forward and the backward pass a block keeps its input alone, ``[rows,
positions, d_model]`` (Megatron-Core's ``--recompute-granularity full
--recompute-method uniform`` with one layer per group); its parameters are the state's.

``prevent_cse`` puts an ``optimization_barrier`` on the recomputation's inputs, without
which XLA may merge the recomputation with the forward values it repeats and keep those
alive after all. XLA:GPU, and XLA:CPU from jax 0.11.2, keep that barrier until the step
is scheduled; XLA:CPU up to jax 0.10.2 dropped it first, and there the compiled memory
did not fall (``docs/xla_notes.md``).

How a block is called is the caller's: the plain call, or under fully sharded parameters
(``train.zero 3``) the block's gather and call (:func:`jaxmoe.parallel.fsdp.gathering_call`),
so that the recomputed call gathers the block's parameters once more in the backward
pass, as it does without recomputation.

``"attention"`` (selective, Megatron-Core's default) recomputes the core attention only:
:mod:`jaxmoe.layers.attention`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

# How a block is called: ``(block, index, *args) -> block's outputs``.
BlockCall = Callable[..., Any]


def plain_call(block: nnx.Module, index: int, *args: Any) -> Any:
    """``block(*args)``: a block whose parameters are whole on every device."""
    del index
    return block(*args)


def recomputed(block: nnx.Module, index: int, call: BlockCall, *args: Any) -> Any:
    """``call(block, index, *args)``, its activations recomputed in the backward pass."""
    graphdef, state = nnx.split(block)

    def run(state: Any, args: tuple[Any, ...]) -> Any:
        return call(nnx.merge(graphdef, state), index, *args)

    return jax.checkpoint(run, prevent_cse=True)(state, args)


def call_block(
    recompute: str, block: nnx.Module, index: int, *args: Any, call: BlockCall | None = None
) -> Any:
    """Block ``index`` called on ``args`` through ``call`` (default :func:`plain_call`),
    under :func:`recomputed` when ``recompute`` (``model.recompute``) is ``"layer"``."""
    call = call or plain_call
    if recompute == "layer":
        return recomputed(block, index, call, *args)
    return call(block, index, *args)
