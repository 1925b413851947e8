"""How the step reads the parameters its state holds: one strategy per ZeRO stage.

The state holds each parameter whole on every replica (no ZeRO) or as shards over its
replicas (:mod:`jaxmoe.parallel.zero`). The step asks its :class:`Weights` three things,
in this order, and never which stage it runs:

- :meth:`~Weights.for_step`: what the microbatches (or a pipeline's ticks) differentiate,
  taken once before the first of them. ZeRO-1 gathers every parameter here.
- :meth:`~Weights.for_forward`: inside each forward pass, the parameters the model reads
  and how it calls its blocks. ZeRO-3 gathers the parameters outside the blocks here and
  has each block gather its own (:func:`jaxmoe.parallel.fsdp.gathering_call`).
- :meth:`~Weights.gradients`: the differentiated gradients in the dtypes the gradient
  synchronisation sums them in (ZeRO-1 differentiates parameters gathered in the compute
  dtype, and sums their gradients in the parameters' float32).

:func:`weights_for` chooses the strategy once, from the ZeRO layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

from jaxmoe.parallel.fsdp import gathering_call
from jaxmoe.parallel.zero import ZeroLayout, gather_all, gather_outside_blocks

PyTree = Any


class Weights:
    """Every replica holds each parameter whole: the step reads them as they are."""

    def for_step(self, params: PyTree) -> PyTree:
        return params

    def for_forward(self, weights: PyTree) -> tuple[PyTree, Any]:
        """The parameters the model reads and its block call (None: the plain call)."""
        return weights, None

    def gradients(self, grads: PyTree, params: PyTree) -> PyTree:
        del params
        return grads


@dataclass(frozen=True)
class GatheredOnce(Weights):
    """ZeRO-1 (the distributed optimizer): every parameter gathered at the start of the
    step, unit by unit, and differentiated whole."""

    plan: ZeroLayout

    def for_step(self, params: PyTree) -> PyTree:
        return gather_all(params, self.plan)

    def gradients(self, grads: PyTree, params: PyTree) -> PyTree:
        return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


@dataclass(frozen=True)
class GatheredPerBlock(Weights):
    """ZeRO-3: the parameters outside the blocks gathered at the start of each forward
    pass, each block's gathered by the block right before it runs."""

    plan: ZeroLayout

    def for_forward(self, weights: PyTree) -> tuple[PyTree, Any]:
        return gather_outside_blocks(weights, self.plan), gathering_call(self.plan)


def weights_for(plan: ZeroLayout | None) -> Weights:
    """The strategy for the state's parameters under ``plan`` (None: no ZeRO)."""
    if plan is None:
        return Weights()
    return GatheredOnce(plan) if plan.stage == 1 else GatheredPerBlock(plan)
