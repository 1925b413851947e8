"""Gradients summed across replicas in a narrower dtype (``train.grad_reduce_dtype``).

:class:`ReducedIn` wraps any algorithm that sums the gradients as it is given them
(``allreduce``, ``bucketed``, ``hierarchical``, and ZeRO-1's reduce-scatters): each
floating-point gradient is cast to the dtype before the algorithm runs and its result
cast back to the gradient's own dtype (float32, what the optimizer reads) after it.
ZeRO-3 reduce-scatters each block's gradients inside the backward pass, in the
derivative of the block's gathers, which take the dtype from the ZeRO layout
(:attr:`jaxmoe.parallel.zero.ZeroLayout.reduce_dtype`); what reaches the algorithm then
is already summed in it (casting it again is exact).
Megatron-Core's ``--grad-reduce-in-bf16``: half the bytes on the wire, and the sums
rounded to bfloat16's 8 bits of mantissa at each step of the reduction.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, PyTree, Synced


@dataclasses.dataclass(frozen=True)
class ReducedIn(GradSync):
    """``inner`` run on the gradients cast to ``dtype``, its result cast back."""

    inner: GradSync
    dtype: jnp.dtype

    def init_state(self, params: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
        return self.inner.init_state(params, specs, mesh_axes)

    def state_specs(self, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
        return self.inner.state_specs(specs, mesh_axes)

    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        dtypes = jax.tree.map(lambda g: g.dtype, grads)
        narrow = jax.tree.map(
            lambda g: g.astype(self.dtype) if jnp.issubdtype(g.dtype, jnp.floating) else g,
            grads,
        )
        synced = self.inner(narrow, state, specs, mesh_axes)
        restored = jax.tree.map(lambda g, dtype: g.astype(dtype), synced.grads, dtypes)
        return synced._replace(grads=restored)

    def after_update(
        self, params: PyTree, step: jax.Array, specs: PyTree, mesh_axes: MeshAxes
    ) -> PyTree:
        return self.inner.after_update(params, step, specs, mesh_axes)
