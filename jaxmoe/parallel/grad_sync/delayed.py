"""``delayed``: the update of step t applies the gradients reduced at step t - 1.

One step of staleness (BAGUA's asynchronous/delayed communication; the
analysis of Lian et al., "Asynchronous Parallel Stochastic Gradient for
Nonconvex Optimization", NeurIPS 2015, and Stich & Karimireddy 2020): the
reduction of step t's gradients has a whole step (the next forward and
backward) to finish before anything needs it, so it can hide behind
computation. Step t computes ``x_{t+1} = x_t - lr * update(g(x_{t-1}))``;
SGD with a bounded delay tau converges at the synchronous rate when the
learning rate is O(1 / tau) smaller than the largest stable synchronous one
(here tau = 1, so the usual rates apply for the schedules jaxmoe uses).

The reduced gradients wait in ``TrainState.grad_sync['pending']``, with
``'valid'`` saying whether they exist. Step 0 has nothing to apply: it
reduces its gradients and leaves parameters and optimizer state unchanged
(``Synced.apply`` is false). So the optimizer's count, which drives the
learning-rate schedule, lags the step counter by one: the gradient of step
t - 1 is applied with the learning rate of step t - 1, the schedule the
synchronous run would use for it; the gradients of a run's last step stay
pending. Pending gradients are part of the state, so a checkpoint holds them
and a resumed run applies them exactly as the uninterrupted run would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, PyTree, Synced
from jaxmoe.parallel.sharding import reduce_gradients


class Delayed(GradSync):
    def init_state(self, params: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
        del specs, mesh_axes
        return {
            "pending": jax.tree.map(jnp.zeros_like, params),
            "valid": jnp.zeros((), jnp.bool_),
        }

    def state_specs(self, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
        del mesh_axes
        # Reduced gradients are laid out like their parameters.
        return {"pending": specs, "valid": PartitionSpec()}

    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        del mesh_axes
        reduced = reduce_gradients(grads, specs)
        return Synced(
            grads=state["pending"],
            state={"pending": reduced, "valid": jnp.ones((), jnp.bool_)},
            apply=state["valid"],
        )
