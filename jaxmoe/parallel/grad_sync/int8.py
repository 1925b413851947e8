"""``int8``: gradients exchanged as 8-bit codes, with error feedback (BAGUA's ByteGrad).

Only the exchange between hosts is quantised (hosts as in :mod:`.hierarchical`).
Per bucket of gradients (fused as in :mod:`.bucketed`), on each device:
``v = g + e`` (this device's gradient plus the residual kept from the previous
step). Where a replica group has several members on each of several hosts, the
members of a host reduce-scatter ``v`` exactly (float32, inside the host); each
quantises its shard, ``q = Q(shard)`` with the per-chunk min/max quantiser of
:mod:`.quantize`, keeps ``e' = shard - D(q)`` at the shard's place (zero
elsewhere), and all-gathers the codes (1 byte per value plus two floats per
chunk) from its counterparts on the other hosts; every device decodes and sums
them in the same order, and the host all-gathers the summed shards. Where each
host holds one member of the group (or one host holds all of it, or
``devices_per_host`` is 1), every member quantises its whole ``v`` and the codes
are all-gathered over the group. Either way the replicas apply identical
gradients and stay identical.

What it changes: step t applies ``sum_i D(Q(g_i^t + e_i^t))`` instead of
``sum_i g_i^t``. With error feedback nothing is lost, only delayed: summed over
steps, the applied gradients differ from the exact ones by the residuals still
held, ``sum_t applied_t = sum_t exact_t - sum_i e_i^T``, and each residual is at
most half a quantisation step per value. This is the error-feedback argument of
Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes" (ICML 2019) and Stich et al., "Sparsified SGD with Memory"
(2018). Their condition is a compressor with bounded relative error,
``||x - C(x)||^2 <= (1 - delta) ||x||^2``: here each value is off by at most
half a step, ``(max - min) / 510 <= max|x| / 255``, so over a chunk of c values
``||x - C(x)||^2 <= c / 255^2 * ||x||^2`` (0.016 for c = 1024). Under it, SGD
with error feedback converges at the rate of uncompressed SGD up to
higher-order terms, while without feedback the bias of a deterministic
quantiser can accumulate (the unit tests show both). BAGUA (Gan et al., VLDB
2022) ships this scheme as ByteGrad.

Bytes on the wire: with L members per host, each device sends its 1/L shard
of the bucket across hosts as 1-byte codes where ``hierarchical`` sends 4-byte
floats: 4x fewer bytes on the link. With one member per host, each device
receives (n - 1) copies of a 1-byte code per value against about
2 (n - 1) / n x 4 bytes for a ring all-reduce of float32: 4x fewer across 2
replicas, break-even at 8.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmoe.parallel.grad_sync.base import (
    ErrorFeedback,
    MeshAxes,
    PyTree,
    Synced,
)
from jaxmoe.parallel.grad_sync.bucketed import map_buckets
from jaxmoe.parallel.grad_sync.hierarchical import Groups, host_groups
from jaxmoe.parallel.grad_sync.quantize import DEFAULT_CHUNK, dequantize, quantize
from jaxmoe.parallel.sharding import replicated_axes


def quantized_sum(
    value: jax.Array, axes: tuple[str, ...], chunk: int, groups: Groups | None = None
) -> tuple[jax.Array, jax.Array]:
    """``(sum over the group of every device's decoded Q(value), value - D(Q(value)))``; the
    group is every device along ``axes``, or this device's one of ``groups``."""
    q = quantize(value, chunk)
    residual = value - dequantize(q, value.shape, value.dtype)
    gather = lambda part: jax.lax.all_gather(part, axes, axis_index_groups=groups)
    decoded = dequantize(jax.tree.map(gather, q), value.shape, jnp.float32)
    # The members' values added one after another (elementwise, fused with the decoding),
    # not reduced over the gathered axis: XLA:CPU runs that short leading-axis reduction
    # as a kernel of its own, tens of times slower than the additions when fake devices
    # share the cores (grad_sync_trace_before_int8_sum.md).
    summed = functools.reduce(jnp.add, [decoded[i] for i in range(decoded.shape[0])])
    return summed.astype(value.dtype), residual


def hierarchical_quantized_sum(
    flat: jax.Array, axes: tuple[str, ...], inside: Groups, across: Groups, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """The sum over the replica group with only the cross-host step quantised, and this
    device's residual: zero but for the shard it quantised."""
    local = len(inside[0])
    padded = jnp.pad(flat, (0, -flat.size % local))
    shard = jax.lax.psum_scatter(padded, axes, axis_index_groups=inside, tiled=True)
    summed, shard_residual = quantized_sum(shard, axes, chunk, across)
    gathered = jax.lax.all_gather(summed, axes, axis_index_groups=inside, tiled=True)
    # This device's place in its host's group: which shard it holds.
    place = [0] * sum(len(group) for group in inside)
    for group in inside:
        for position, member in enumerate(group):
            place[member] = position
    position = jnp.asarray(place)[jax.lax.axis_index(axes)]
    residual = jax.lax.dynamic_update_slice(
        jnp.zeros_like(padded), shard_residual, (position * shard.size,)
    )
    return gathered[: flat.size], residual[: flat.size]


@dataclass(frozen=True)
class Int8(ErrorFeedback):
    bucket_bytes: int = 25 * 2**20
    # Hosts (see hierarchical.py); 1: every device its own host, every exchange quantised.
    devices_per_host: int = 1
    chunk: int = DEFAULT_CHUNK
    # Tests turn it off to show what error feedback is for.
    error_feedback: bool = True

    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        values = self.with_residual(grads, state)

        def exchange(flat, axes):
            inside, across = host_groups(axes, mesh_axes, self.devices_per_host)
            if len(inside) == 1 or len(inside[0]) == 1:  # one host, or one member per host
                return quantized_sum(flat, axes, self.chunk)
            return hierarchical_quantized_sum(flat, axes, inside, across, self.chunk)

        reduced, residual = map_buckets(values, specs, self.bucket_bytes, exchange, num_outputs=2)
        # Nothing is kept for leaves that were not exchanged, nor without feedback.
        keep = lambda r, spec: r if self.error_feedback and replicated_axes(spec) else 0 * r
        residual = jax.tree.map(lambda r, spec: keep(r, spec)[None], residual, specs)
        return Synced(reduced, {"residual": residual})
