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
alive after all; XLA:CPU drops that barrier (see the architecture notes), so on CPU the
compiled memory need not fall by what the captured program says it should.

Under fully sharded parameters (``train.zero 3``) the recomputed call is the block's
gather and call (:func:`jaxmoe.parallel.fsdp.call_block`), so the backward pass gathers
the block's parameters once more, as it does without recomputation.

``"attention"`` (selective, Megatron-Core's default) recomputes the core attention only:
:mod:`jaxmoe.layers.attention`.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxmoe.parallel import fsdp


def recomputed(block: nnx.Module, index: int, *args: Any) -> Any:
    """The call of block ``index`` on ``args``, its activations recomputed in the backward
    pass."""
    graphdef, state = nnx.split(block)

    def run(state: Any, args: tuple[Any, ...]) -> Any:
        return fsdp.call_block(nnx.merge(graphdef, state), index, *args)

    return jax.checkpoint(run, prevent_cse=True)(state, args)


def call_block(recompute: str, block: nnx.Module, index: int, *args: Any) -> Any:
    """``block(*args)`` (through :func:`jaxmoe.parallel.fsdp.call_block`), under
    :func:`recomputed` when ``recompute`` (``model.recompute``) is ``"layer"``; ``index``:
    the block's layer."""
    if recompute == "layer":
        return recomputed(block, index, *args)
    return fsdp.call_block(block, index, *args)
