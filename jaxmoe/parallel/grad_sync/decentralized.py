"""``decentralized``: each worker steps on its own gradient, then averages its parameters
with its neighbours' on a ring of workers (decentralized SGD, as in BAGUA).

D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?
A Case Study for Decentralized Parallel Stochastic Gradient Descent", NeurIPS 2017),
which BAGUA (Gan et al., VLDB 2022) ships as its decentralized algorithm, in BAGUA's
default hierarchical mode: a worker is one host's replicas of a parameter
(:mod:`.workers`: exact inside a host, decentralized between hosts). No gradient is
all-reduced across hosts. Each step:

1. the gradient is the worker's own (:func:`~.workers.worker_gradients`: the gradient
   of the mean loss of its host's rows, summed exactly inside the host), and the
   optimizer applies it to the worker's parameters;
2. :meth:`Decentralized.after_update` mixes the updated parameters with the
   neighbouring workers' on the ring of hosts: ``x_h <- (x_{h-1} + x_h + x_{h+1}) / 3``,
   or with 2 hosts the pair's mean ``(x_h + x_{h'}) / 2``. Per bucket of parameters
   (fused as in :mod:`.bucketed`), each of a host's L members sends a ``1/L`` share to
   its counterparts on the neighbouring hosts (one ``ppermute`` per neighbour) and the
   host gathers the mixed shares back (:func:`~.workers.across_hosts`).

That is ``x^{t+1} = W (x^t - lr u^t)``, ``u_h`` the optimizer's update of worker h's
gradient and W the ring's mixing matrix: the order (local step, then gossip) that
Koloskova et al. analyse ("A Unified Theory of Decentralized SGD with Changing Topology
and Local Updates", ICML 2020). BAGUA mixes first (``W x^t - lr u^t``, its exchange
overlapping the backward pass); the rates are the same. A host sends its parameters to
two neighbours whatever the number of hosts, one hop each, against about
``2 (H - 1) / H`` times its gradients over ``2 (H - 1)`` latency steps for a ring
all-reduce across H hosts: the same bytes for few hosts, far fewer hops for many.

What it changes: W (1/3 on the diagonal and on the two neighbours) is doubly
stochastic, so the mean over workers follows the mean of their updates exactly, while a
worker's distance to the mean contracts by ``|lambda_2(W)|`` per step (0.80 for a ring
of 8, 0 for a pair: the pair's mean is exact) and grows by its own update's deviation
from the mean. D-PSGD's guarantee rests on this: the rate of centralised SGD,
``O(1 / sqrt(nT))``, once T is large enough, and the smaller the spectral gap
``1 - |lambda_2|``, the larger. Each worker also keeps its own optimizer state (AdamW's
moments of its own gradients), as BAGUA's workers do. With 2 hosts the parameters are
the same everywhere after every step and only the optimizer states differ; with one
host nothing is relaxed (exact up to float rounding).

The workers' parameters differ, but stay declared replicated: metrics and evaluation
average each replica's loss on its own rows; the gradient norm, and so clipping and the
non-finite check, are each worker's own. A checkpoint holds one replica's parameters and
optimizer state (Orbax writes each array from its first replica), and a resumed run
starts every worker from them: the workers' disagreement starts again from zero, so a
resumed run does not retrace the uninterrupted one bit for bit as allreduce's does.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, PyTree, Synced
from jaxmoe.parallel.grad_sync.workers import (
    Replicas,
    between_workers,
    host_perm,
    ring_shifts,
    worker_gradients,
)

# The name scope of the parameter mixing (see map_buckets).
MIX_SCOPE = "param_mix"


def from_host(value: jax.Array, group: Replicas, shift: int) -> jax.Array:
    """The value of the member at this device's place on the host ``shift`` hosts back."""
    return jax.lax.ppermute(value, group.axes, host_perm(group.across, shift))


def ring_mix(value: jax.Array, group: Replicas) -> jax.Array:
    """This worker's value mixed with its neighbours' on the ring of hosts (``W x``)."""
    shifts = ring_shifts(group.hosts)
    mixed = value
    for shift in shifts:
        mixed = mixed + from_host(value, group, shift)
    return mixed / (1 + len(shifts))


@dataclass(frozen=True)
class Decentralized(GradSync):
    bucket_bytes: int = 25 * 2**20
    # Hosts (see hierarchical.py); 1: every device a worker of its own.
    devices_per_host: int = 1

    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        own = worker_gradients(grads, specs, mesh_axes, self.devices_per_host, self.bucket_bytes)
        return Synced(own, state)

    def mix(self, share: jax.Array, group: Replicas) -> jax.Array:
        """A worker's share of a bucket of parameters mixed with its neighbours'."""
        return ring_mix(share, group)

    @property
    def align(self) -> int:
        """Buckets and shares hold whole blocks of this many elements (between_workers)."""
        return 1

    def after_update(
        self, params: PyTree, step: jax.Array, specs: PyTree, mesh_axes: MeshAxes
    ) -> PyTree:
        del step  # the ring is the same every step

        return between_workers(
            params,
            specs,
            mesh_axes,
            self.devices_per_host,
            self.bucket_bytes,
            self.mix,
            scope=MIX_SCOPE,
            align=self.align,
        )
