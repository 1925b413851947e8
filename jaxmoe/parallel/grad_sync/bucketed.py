"""``bucketed``: gradients fused into flat buckets, one psum per bucket (PyTorch DDP, BAGUA).

Gradients whose parameters are replicated on the same mesh axes (and have the
same dtype) are flattened and concatenated, in reverse parameter order, into
buckets of at most ``train.grad_bucket_bytes`` (a larger gradient is a bucket
of its own); each bucket is reduced by one psum. Reverse order is roughly the
order backward produces the gradients (last block first), so a bucket is
complete as early as possible and its reduction can overlap the rest of the
backward pass once the scheduler places it.

The reduced gradients equal ``allreduce``'s bit for bit: a psum adds the same
elements in the same order whether they travel alone or inside a bucket, and
concatenating and slicing move values without rounding them. The whole step
agrees with ``allreduce``'s to a few ulps only: XLA compiles the code around
the reduction (the optimizer's elementwise arithmetic now reads slices of one
buffer) into other fusions, which may round differently (e.g. where a multiply
and an add are contracted into one fused multiply-add). Adam's first update is
about ``lr * sign(g)``, which hides such differences; later ones show them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, PyTree, Synced
from jaxmoe.parallel.sharding import replicated_axes


@dataclass
class _Bucket:
    axes: tuple[str, ...]
    leaves: list[int] = field(default_factory=list)
    nbytes: int = 0


def plan_buckets(
    grads: list[jax.Array], axes: list[tuple[str, ...]], bucket_bytes: int
) -> list[_Bucket]:
    """Group leaf indices into buckets, walking the leaves from last to first."""
    done: list[_Bucket] = []
    open_buckets: dict[tuple, _Bucket] = {}
    for index in reversed(range(len(grads))):
        if not axes[index]:
            continue  # sharded on every axis: nothing to reduce
        key = (axes[index], grads[index].dtype)
        nbytes = grads[index].size * grads[index].dtype.itemsize
        bucket = open_buckets.get(key)
        if bucket is not None and bucket.nbytes + nbytes > bucket_bytes:
            done.append(open_buckets.pop(key))
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = _Bucket(axes[index])
        bucket.leaves.append(index)
        bucket.nbytes += nbytes
    return done + list(open_buckets.values())


# Reduces one flat bucket over the given mesh axes; returns one or more flat arrays of
# the bucket's size (e.g. the reduced values and a residual).
BucketFn = Callable[[jax.Array, tuple[str, ...]], tuple[jax.Array, ...]]


def map_buckets(
    grads: PyTree,
    specs: PyTree,
    bucket_bytes: int,
    reduce: BucketFn,
    num_outputs: int = 1,
    *,
    group_axes: Callable[[PartitionSpec], tuple[str, ...]] = replicated_axes,
    align: int = 1,
    scope: str = "grad_reduce",
) -> tuple[PyTree, ...]:
    """``reduce`` applied to each bucket of ``grads`` (see :func:`plan_buckets`); one tree
    per output of ``reduce`` (``num_outputs``). Leaves sharded on every axis are passed
    through as they are, into every output.

    ``group_axes``: the mesh axes each leaf's exchange runs over, from its spec (by default
    those it is replicated on); leaves with none are passed through. ``align``: each leaf
    starts at a multiple of this many elements of its bucket (padded with its last value),
    so that blocks of ``align`` (quantisation chunks) never mix two leaves. ``scope``: the
    name scope of each bucket's ops (``{scope}/bucket{n}``)."""
    leaves, treedef = jax.tree.flatten(grads)
    axes = [group_axes(spec) for spec in treedef.flatten_up_to(specs)]
    outputs = [list(leaves) for _ in range(num_outputs)]

    def padded(leaf: jax.Array) -> jax.Array:
        flat = leaf.ravel()
        return jnp.pad(flat, (0, -flat.size % align), mode="edge") if align > 1 else flat

    for number, bucket in enumerate(plan_buckets(leaves, axes, bucket_bytes)):
        with jax.named_scope(f"{scope}/bucket{number}"):
            pieces = [padded(leaves[i]) for i in bucket.leaves]
            reduced = reduce(jnp.concatenate(pieces), bucket.axes)
            for output, values in zip(outputs, reduced, strict=True):
                offset = 0
                for i, piece in zip(bucket.leaves, pieces, strict=True):
                    size = leaves[i].size
                    output[i] = values[offset : offset + size].reshape(leaves[i].shape)
                    offset += piece.size
    return tuple(jax.tree.unflatten(treedef, output) for output in outputs)


@dataclass(frozen=True)
class Bucketed(GradSync):
    bucket_bytes: int

    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        del mesh_axes
        psum = lambda flat, axes: (jax.lax.psum(flat, axes),)
        (reduced,) = map_buckets(grads, specs, self.bucket_bytes, psum)
        return Synced(reduced, state)
