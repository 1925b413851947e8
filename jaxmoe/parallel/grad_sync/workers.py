"""Workers: what keeps a gradient, or parameters, of its own under the relaxed algorithms.

A parameter's replicas lie along the mesh axes it is not split over. Those of them that
split the batch's rows (data, and the axes folded with it: :func:`worker_axes`) hold
different rows, so each has a loss and a gradient of its own; the others (tensor) split
one computation, and their gradients are always summed exactly. Of the replicas along
the row axes, those on one host (as in :mod:`.hierarchical`: a run of
``train.grad_sync_devices_per_host`` consecutive devices, or each process) exchange
through memory, so they sum their gradients exactly too, every step: a *worker* is one
host's replicas of a parameter, and the relaxed algorithms relax only what crosses
hosts (BAGUA's hierarchical mode, its default: exact inside a node, decentralized
between nodes). Hosts of one device make every replica a worker; one host makes the
whole group one worker, and nothing is relaxed.

The replicas of one worker stay identical (they apply the same summed gradient to the
same parameters with the same optimizer state), so an exchange between workers needs
only a ``1/L`` share of a bucket from each of a host's L members (:func:`across_hosts`):
each member exchanges its share with the members holding the same share on the other
hosts, then the host's members gather the shares back, as ``hierarchical`` does for its
cross-host sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoe.config.layout import ATTENTION_DATA, axes_for_role
from jaxmoe.parallel.grad_sync.base import MeshAxes, PyTree
from jaxmoe.parallel.grad_sync.bucketed import map_buckets
from jaxmoe.parallel.grad_sync.hierarchical import Groups, host_groups
from jaxmoe.parallel.sharding import replicated_axes


def worker_axes(mesh_axes: MeshAxes) -> tuple[str, ...]:
    """The mesh axes that split the batch's rows: each index along them holds rows, so a
    loss and a gradient, of its own."""
    return axes_for_role(ATTENTION_DATA, tuple(mesh_axes))


@dataclass(frozen=True)
class Replicas:
    """A parameter's replicas along the row axes, by host."""

    axes: tuple[str, ...]  # the row axes the parameter is replicated on
    inside: Groups  # axis_index_groups over ``axes``: the members on each host
    across: Groups  # the members holding the same place on each host, by host

    @property
    def hosts(self) -> int:
        """The workers: hosts holding replicas of the parameter."""
        return len(self.inside)

    @property
    def per_host(self) -> int:
        return len(self.inside[0])


def replicas_over(axes: tuple[str, ...], mesh_axes: MeshAxes, devices_per_host: int) -> Replicas:
    """The replicas of a parameter replicated on the row axes ``axes``, by host."""
    if not axes:
        return Replicas((), ((0,),), ((0,),))
    inside, across = host_groups(axes, mesh_axes, devices_per_host)
    return Replicas(axes, inside, across)


def replicas(spec: PartitionSpec, mesh_axes: MeshAxes, devices_per_host: int) -> Replicas:
    """How ``spec``'s parameter is replicated over workers on a mesh of ``mesh_axes``."""
    rows = worker_axes(mesh_axes)
    axes = tuple(a for a in replicated_axes(spec, tuple(mesh_axes)) if a in rows)
    return replicas_over(axes, mesh_axes, devices_per_host)


def exchanged_axes(mesh_axes: MeshAxes, devices_per_host: int):
    """For :func:`~.bucketed.map_buckets`: the row axes of a parameter whose replicas span
    more than one host (the others are passed through: no worker to exchange with)."""

    def axes(spec: PartitionSpec) -> tuple[str, ...]:
        group = replicas(spec, mesh_axes, devices_per_host)
        return group.axes if group.hosts > 1 else ()

    return axes


def worker_gradients(
    grads: PyTree, specs: PyTree, mesh_axes: MeshAxes, devices_per_host: int, bucket_bytes: int
) -> PyTree:
    """Per device: the gradient of its worker's own mean loss, for each parameter.

    Summed exactly over the replicas that share the rows (tensor) and over the replicas
    on this host, not across hosts, and scaled by the number of workers: each device
    differentiates its loss divided by every token shard, so the workers' sums add up to
    the gradient of the global mean loss, and ``H`` times one of them is the gradient of
    that worker's mean loss (its own rows, ``1/H`` of the batch). Fused into buckets of
    at most ``bucket_bytes`` (:mod:`.bucketed`): one psum per bucket, not per parameter."""
    names, rows = tuple(mesh_axes), worker_axes(mesh_axes)

    def shared_rows(spec: PartitionSpec) -> tuple[str, ...]:
        return tuple(a for a in replicated_axes(spec, names) if a not in rows)

    def row_replicas(spec: PartitionSpec) -> tuple[str, ...]:
        return replicas(spec, mesh_axes, devices_per_host).axes

    def in_host(flat: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array]:
        group = replicas_over(axes, mesh_axes, devices_per_host)
        if group.hosts == 1:
            flat = jax.lax.psum(flat, axes)
        elif group.per_host > 1:
            flat = jax.lax.psum(flat, axes, axis_index_groups=group.inside)
        return (flat * group.hosts,)

    psum = lambda flat, axes: (jax.lax.psum(flat, axes),)
    (grads,) = map_buckets(grads, specs, bucket_bytes, psum, group_axes=shared_rows)
    (grads,) = map_buckets(grads, specs, bucket_bytes, in_host, group_axes=row_replicas)
    return grads


def host_perm(across: Groups, shift: int) -> list[tuple[int, int]]:
    """A ``ppermute`` over the group's axes: each member sends to the member at its place on
    the host ``shift`` hosts on (a ring of hosts)."""
    return [
        (members[h], members[(h + shift) % len(members)])
        for members in across
        for h in range(len(members))
    ]


def ring_shifts(hosts: int) -> tuple[int, ...]:
    """The neighbours a worker mixes with on a ring of ``hosts``, as host shifts: both
    neighbours, the one peer of a pair, none alone. Each weighs as much as the worker
    itself (the mixing matrix W is doubly stochastic)."""
    return () if hosts == 1 else (1,) if hosts == 2 else (1, -1)


def across_hosts(flat: jax.Array, group: Replicas, exchange, align: int = 1) -> jax.Array:
    """``exchange`` (a function of this device's share of ``flat``, communicating only
    with the members that hold the same share on other hosts) applied to every share of
    ``flat``, which must be the same on every member of a host; the shares are gathered
    back inside the host. Shares are multiples of ``align`` elements (padded with the last
    value)."""
    local = group.per_host
    if local == 1:
        return exchange(flat)
    share = math.ceil(flat.size / (local * align)) * align
    padded = jnp.pad(flat, (0, share * local - flat.size), mode="edge")
    # This device's place in its host: which share it exchanges.
    place = [0] * sum(len(members) for members in group.inside)
    for members in group.inside:
        for position, member in enumerate(members):
            place[member] = position
    position = jnp.asarray(place)[jax.lax.axis_index(group.axes)]
    mine = jax.lax.dynamic_slice(padded, (position * share,), (share,))
    exchanged = exchange(mine)
    gathered = jax.lax.all_gather(exchanged, group.axes, axis_index_groups=group.inside, tiled=True)
    return gathered[: flat.size]


def between_workers(
    tree: PyTree,
    specs: PyTree,
    mesh_axes: MeshAxes,
    devices_per_host: int,
    bucket_bytes: int,
    exchange: Callable[[jax.Array, Replicas], jax.Array],
    *,
    scope: str,
    align: int = 1,
) -> PyTree:
    """``exchange(share, replicas)`` between the workers of every bucket of ``tree`` (whose
    replicas on one host are the same), each host's members exchanging a share each
    (:func:`across_hosts`); leaves whose replicas lie on one host are passed through.
    ``align``: buckets and shares hold whole blocks of this many elements; ``scope``: the
    buckets' name scope (:func:`~.bucketed.map_buckets`)."""

    def per_bucket(flat: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array]:
        group = replicas_over(axes, mesh_axes, devices_per_host)
        return (across_hosts(flat, group, lambda share: exchange(share, group), align=align),)

    (exchanged,) = map_buckets(
        tree,
        specs,
        bucket_bytes,
        per_bucket,
        group_axes=exchanged_axes(mesh_axes, devices_per_host),
        align=align,
        scope=scope,
    )
    return exchanged
