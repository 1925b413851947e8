"""Fully sharded blocks (``train.zero 3``): each block gathers its parameters right before
it runs, and again in the backward pass.

The ZeRO-3 step hands the model :func:`gathering_call` as the way to call each block.
The block's parameters are then the shards of :mod:`jaxmoe.parallel.zero`: the call gathers
them (:func:`~jaxmoe.parallel.zero.gather_params`, one all_gather per parameter, under
``param_gather/layer_<i>``), runs the block on them, and wraps both in ``jax.checkpoint``
with every value saved for the backward pass except the outputs of those all_gathers
(JAX's shard_map FSDP recipe). A gather's output is the very array the block's matmuls
read (the model's cast to the compute dtype is then the identity), so the backward pass
of block i gathers block i's parameters again right before it needs them, nothing else
is recomputed, and no block's gathered parameters outlive its forward or backward pass.
The gathers' derivatives reduce-scatter the block's gradients onto the shards.

The policy knows the parameters' gathers by their axes (those of the block's shards); an
all_gather of activations over the same axes (a sequence-parallel gather whose tensor
group is every replica of a parameter) is then gathered again in the backward pass too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from jaxmoe.parallel.zero import GATHER_NAME, ZeroLayout, gather_axes, gather_params


@dataclass(frozen=True)
class GatheringCall:
    """How the blocks of ``plan``'s shards are called: ``(block, index, *args)`` gathers
    block ``index``'s parameters and runs it on them (see the module docstring)."""

    plan: ZeroLayout

    def __call__(self, block: nnx.Module, index: int, *args: Any) -> Any:
        graphdef, params, rest = nnx.split(block, nnx.Param, ...)
        shards = nnx.to_pure_dict(params)
        others = nnx.to_pure_dict(rest)
        layouts = self.plan.unit(self.plan.layouts, index)
        dtypes = self.plan.unit(self.plan.gather_dtypes, index)

        def run(shards: Any, others: Any, args: tuple[Any, ...]) -> Any:
            gathered = gather_params(
                shards, layouts, dtypes, f"layer_{index}", self.plan.reduce_dtype
            )
            states = [gathered, others] if jax.tree.leaves(others) else [gathered]
            return nnx.merge(graphdef, *states)(*args)

        policy = _saving_all_but(self.regathered(index))
        return jax.checkpoint(run, policy=policy)(shards, others, args)

    def regathered(self, index: int) -> Callable[..., bool]:
        """Whether a value block ``index`` makes is a gather of its parameters, gathered
        again in the backward pass rather than kept, under any recomputation too
        (:mod:`jaxmoe.layers.recompute`): ``(primitive, **params) -> bool``."""
        axes = gather_axes(self.plan.unit(self.plan.layouts, index))

        def gathers(primitive: Any, **params: Any) -> bool:
            if primitive.name == "custom_vjp_call":
                return params.get("name") == GATHER_NAME
            if primitive.name == "all_gather":
                names = params.get("axis_name", ())
                return (tuple(names) if isinstance(names, tuple | list) else (names,)) in axes
            return False

        return gathers


def gathering_call(plan: ZeroLayout) -> GatheringCall:
    """How the blocks of ``plan``'s shards are called (:class:`GatheringCall`)."""
    return GatheringCall(plan)


def _saving_all_but(regathered: Callable[..., bool]) -> Any:
    """A rematerialisation policy: save every value but the parameters' gathers (the
    custom_vjp of :func:`~jaxmoe.parallel.zero.gather_param` and, once JAX has inlined
    it, its all_gather over one of the block's gather axes)."""

    def saveable(primitive: Any, *_: Any, **params: Any) -> bool:
        return not regathered(primitive, **params)

    return saveable
