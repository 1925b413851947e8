"""``decentralized``: each device averages its gradient with its two ring neighbours.

Gossip instead of a global all-reduce (D-PSGD: Lian et al., "Can Decentralized
Algorithms Outperform Centralized Algorithms? A Case Study for Decentralized
Parallel Stochastic Gradient Descent", NeurIPS 2017). The devices a parameter
is replicated on form a ring (in mesh order); device i applies
``n * (g_{i-1} + g_i + g_{i+1}) / 3`` (n replicas; the factor n keeps the scale
of the all-reduced sum), exchanged by two ``ppermute``s: each device sends and
receives 2 x its gradient whatever n is, against about 2 (n - 1) / n x for a
ring all-reduce, but in one hop to a neighbour instead of 2 (n - 1) latency
steps. With 2 replicas it is the all-reduce; with 1 it does nothing. Gradients
are fused into buckets as in :mod:`.bucketed`: two ``ppermute`` per bucket, not
per parameter.

What it changes: the mixing matrix W (1/3 on the diagonal and the two ring
neighbours) replaces the averaging matrix J = 11^T / n, so replicas apply
different gradients and their parameters drift apart; the mean over replicas
still receives the mean gradient (W is doubly stochastic). Here gradients, not
parameters, are gossiped, so nothing pulls the replicas back together: their
distance grows with the learning rate times the accumulated disagreement
``(W - J) g``. D-PSGD's guarantee (parameters mixed every step, rate
O(1/sqrt(nT)) as for centralised SGD) needs a spectral gap
``1 - |lambda_2(W)| > 0`` (a ring of n has one of order 1/n^2) and a learning
rate small against it; with gradient gossip the runs must stay short or the
learning rate decay so that the sum of lr_t x (disagreement) stays small.

The parameters stay declared replicated while their per-device copies differ:
metrics and evaluation average the replicas' losses; the gradient norm, and so
clipping and the non-finite check, are each replica's own; a checkpoint keeps
one replica's parameters (a resumed run starts from that consensus).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax

from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, PyTree, Synced
from jaxmoe.parallel.grad_sync.bucketed import map_buckets


def ring_average(value: jax.Array, axes: tuple[str, ...], replicas: int) -> jax.Array:
    """``replicas`` times the mean of this device's and its ring neighbours' values."""
    if replicas == 1:
        return value
    left = jax.lax.ppermute(value, axes, [(i, (i + 1) % replicas) for i in range(replicas)])
    if replicas == 2:
        return value + left
    right = jax.lax.ppermute(value, axes, [(i, (i - 1) % replicas) for i in range(replicas)])
    return (left + value + right) * (replicas / 3)


@dataclass(frozen=True)
class Decentralized(GradSync):
    bucket_bytes: int = 25 * 2**20

    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        def mix(flat, axes):
            return (ring_average(flat, axes, math.prod(mesh_axes[a] for a in axes)),)

        (mixed,) = map_buckets(grads, specs, self.bucket_bytes, mix)
        return Synced(mixed, state)
