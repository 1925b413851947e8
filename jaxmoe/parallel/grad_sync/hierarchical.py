"""``hierarchical``: reduce inside each host, across hosts once, then gather inside the host.

What a host is. The mesh's devices are numbered row-major over its axes
(``data``, then ``expert``), which is the order :func:`~jaxmoe.parallel.mesh.build_mesh`
lays ``jax.devices()`` out in, process by process; a host is a run of
``devices_per_host`` consecutive devices. ``train.grad_sync_devices_per_host``
sets it (to emulate hosts with fake devices in one process); 0 takes each
process as a host, checked against the processes that own the mesh's devices.

The algorithm, per bucket of gradients (fused as in :mod:`.bucketed`) over the
replica group of the axes its parameters are replicated on: the group's ``L``
members on one host reduce-scatter the bucket among themselves (each ends
with the in-host sum of one ``1/L`` shard); each shard is all-reduced across
the ``H`` hosts by the members holding it, one per host; the members of a host
all-gather the shards back. The link between hosts carries ``1/L`` of the
bucket per device instead of the whole bucket (BAGUA's hierarchical
communication; Horovod's and NCCL's two-level all-reduce). A group with one
member per host (expert gradients across data replicas when a host holds one
expert group) or all on one host is one plain psum, as in ``allreduce``.

Exact up to float rounding: every replica applies the sum of all gradients,
the same on every device, but the additions are grouped differently (in-host
partial sums first), so results differ from ``allreduce``'s by a few ulps of
the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxmoe.config import ConfigError
from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, PyTree, Synced
from jaxmoe.parallel.grad_sync.bucketed import map_buckets

Groups = tuple[tuple[int, ...], ...]


def devices_per_host(configured: int, mesh: Mesh) -> int:
    """``configured``, or (0) the devices of one process, checked to be consecutive in
    the mesh's row-major order."""
    if configured:
        return configured
    processes = [device.process_index for device in mesh.devices.flat]
    per_host = len(processes) // len(set(processes))
    blocks = [processes[i : i + per_host] for i in range(0, len(processes), per_host)]
    if any(len(set(block)) != 1 for block in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise ConfigError(
            "train.grad_sync_devices_per_host=0: the processes' devices are not consecutive "
            "runs of the mesh; set train.grad_sync_devices_per_host to the host size"
        )
    return per_host


def host_groups(axes: tuple[str, ...], mesh_axes: MeshAxes, per_host: int) -> tuple[Groups, Groups]:
    """``(inside, across)`` as ``axis_index_groups`` over ``axes``: the members of each
    replica group that share a host, and the members holding the same shard on each host.

    Raises ConfigError when hosts do not cut every replica group the same way.
    """
    strides, stride = {}, 1
    for name in reversed(list(mesh_axes)):
        strides[name] = stride
        stride *= mesh_axes[name]
    members = [0]  # device offsets of a group's members, in axis_index_groups order
    for axis in axes:
        members = [m + k * strides[axis] for m in members for k in range(mesh_axes[axis])]
    others = [a for a in mesh_axes if a not in axes]
    bases = [0]
    for axis in others:
        bases = [b + k * strides[axis] for b in bases for k in range(mesh_axes[axis])]
    partitions = set()
    for base in bases:
        by_host: dict[int, list[int]] = {}
        for index, offset in enumerate(members):
            by_host.setdefault((base + offset) // per_host, []).append(index)
        partitions.add(tuple(tuple(group) for group in by_host.values()))
    inside = partitions.pop()
    if partitions or len({len(group) for group in inside}) != 1:
        raise ConfigError(
            f"train.grad_sync_devices_per_host={per_host}: hosts of {per_host} consecutive "
            f"devices do not split the replica groups over {axes} evenly; choose a host size "
            "that divides or is a multiple of parallel.expert"
        )
    across = tuple(zip(*inside, strict=True))
    return inside, across


def hierarchical_sum(flat: jax.Array, axes: tuple[str, ...], inside: Groups, across: Groups):
    """Sum of ``flat`` over the replica group: reduce-scatter in-host, psum across hosts of
    each shard, all-gather in-host."""
    local, hosts = len(inside[0]), len(inside)
    if local == 1 or hosts == 1:
        return jax.lax.psum(flat, axes)
    padded = jnp.pad(flat, (0, -flat.size % local))
    shard = jax.lax.psum_scatter(padded, axes, axis_index_groups=inside, tiled=True)
    shard = jax.lax.psum(shard, axes, axis_index_groups=across)
    gathered = jax.lax.all_gather(shard, axes, axis_index_groups=inside, tiled=True)
    return gathered[: flat.size]


@dataclass(frozen=True)
class Hierarchical(GradSync):
    bucket_bytes: int
    devices_per_host: int  # resolved (see devices_per_host); > 0

    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        if math.prod(mesh_axes.values()) % self.devices_per_host:
            raise ConfigError(
                f"train.grad_sync_devices_per_host={self.devices_per_host} does not divide "
                "the mesh's devices"
            )

        def reduce(flat, axes):
            inside, across = host_groups(axes, mesh_axes, self.devices_per_host)
            return (hierarchical_sum(flat, axes, inside, across),)

        (reduced,) = map_buckets(grads, specs, self.bucket_bytes, reduce)
        return Synced(reduced, state)
