"""ZeRO over the replicas of each parameter (``train.zero``): the distributed optimizer (1)
and fully sharded parameters (3).

A parameter is replicated over the mesh axes it is not split over
(:func:`~jaxmoe.parallel.sharding.replicated_axes`): every axis for a dense weight, the
expert-data axes for an expert weight. Under ZeRO those replicas stop holding the same
things: each holds one shard of the float32 parameter (the master copy), of its AdamW
moments and of its reduced gradient. The state stores the shards; the step gathers the
parameters it computes with and reduce-scatters their gradients:

- ``1`` (Megatron-Core's distributed optimizer): each block's parameters (and those
  outside the blocks) are all-gathered at the start of the step, before the forward pass,
  and differentiated as whole parameters; after the backward pass each gradient is
  reduce-scattered (instead of all-reduced) onto the shards, which the optimizer updates.
  The all-gather of the updated shards is the next step's first collectives, so each
  block's gather can overlap the blocks before it (Megatron's ``--overlap-param-gather``).
- ``3`` (ZeRO-3 / FSDP): each block gathers its parameters inside the layer loop, right
  before it runs (:mod:`jaxmoe.parallel.fsdp`), and the backward pass gathers them again
  (the block is rematerialised with every value saved but the gathered parameters), so
  only one block's gathered parameters live at a time; the gather's derivative is the
  reduce-scatter of their gradients. The parameters outside the blocks (embeddings, final
  norm, head) are gathered once at the start of the forward pass.

Layout. A parameter keeps its global shape; its spec gains replicated axes on one
dimension, appended after the axes that dimension is already split over (so a shard is a
block of the device's block): the largest set of replicated axes whose product divides
the dimension's local size, on the first dimension where that set is largest. Replicated
axes that divide none of its dimensions stay replicated for it (a vector of 6 over 4
replicas): their gradient psum remains, and those replicas update the same shard alike,
which is exact. Nothing is padded or flattened (Megatron flattens into padded buckets),
so a checkpoint holds the same global arrays with or without ZeRO, and Orbax restores a
state saved in one layout into another (with or without ZeRO) by reading each array into
the target's sharding.

Each parameter is gathered by its own ``all_gather`` (tiled), whose output is the very
array the model reads; its derivative reduce-scatters the gradient (``psum_scatter``,
tiled) onto the shard. Under ``bucketed`` the gradients of one set of axes and one dtype
are fused into flat buckets, each one ``psum_scatter`` of rows of shards. A parameter is
gathered in the compute dtype where the model reads it only through one cast to it
(``gather dtypes``, :func:`jaxmoe.train.state.gather_dtypes`), else in its own dtype;
its gradient is reduced in the parameter's dtype (float32) either way, as the plain step
reduces it, unless ``train.grad_reduce_dtype`` narrows the sums (ZeRO-3's gathers then
reduce-scatter in that dtype, :attr:`ZeroLayout.reduce_dtype`). Every collective is an
equation of the per-device step under a name scope: ``param_gather/<unit>`` for the
gathers (the scheduler's reports call them ``parameter all_gather``), ``grad_reduce/...``
for the gradients.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import scheduling.names
from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, Synced, local_shape, path_name
from jaxmoe.parallel.grad_sync.bucketed import plan_buckets
from jaxmoe.parallel.sharding import replicated_axes

PyTree = Any
STAGES = (0, 1, 3)
# The gradient-sync algorithms ZeRO composes with (see jaxmoe.config.config).
ZERO_GRAD_SYNCS = ("allreduce", "bucketed")
# The gathers' name scope, which the scheduler prefetches by (scheduling.passes.prefetch).
GATHER_SCOPE = scheduling.names.PARAMETER_GATHER_SCOPE
# The parameters outside the blocks (embeddings, final norm, head): one gather unit.
OUTSIDE_BLOCKS = "outside_blocks"


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter is sharded over its replicas (a pytree leaf, not a node)."""

    dim: int | None  # the dimension split further over ``axes`` (None: not sharded)
    axes: tuple[str, ...]  # the replicated mesh axes it is sharded over, in mesh order
    leftover: tuple[str, ...]  # replicated axes (of size > 1) it stays replicated over
    shards: int = 1  # the product of the sizes of ``axes``

    def shard_shape(self, local: Sequence[int]) -> tuple[int, ...]:
        """The shape of a shard of the device's block of shape ``local``."""
        shape = list(local)
        if self.dim is not None:
            shape[self.dim] //= self.shards
        return tuple(shape)


def shard_layout(shape: Sequence[int], spec: PartitionSpec, mesh_axes: MeshAxes) -> ShardLayout:
    """The layout of a parameter of global ``shape`` and spec ``spec`` (see the module
    docstring): the largest product of its replicated axes that divides one dimension."""
    names = tuple(mesh_axes)
    replicated = [a for a in replicated_axes(spec, names) if mesh_axes[a] > 1]
    local = local_shape(tuple(shape), spec, mesh_axes)
    best: tuple[int, int | None, tuple[str, ...]] = (1, None, ())
    for dim, size in enumerate(local):
        for count in range(len(replicated), 0, -1):
            for axes in itertools.combinations(replicated, count):
                product = math.prod(mesh_axes[a] for a in axes)
                if size % product == 0 and product > best[0]:
                    best = (product, dim, axes)
    shards, dim, axes = best
    leftover = tuple(a for a in replicated if a not in axes)
    return ShardLayout(dim, axes, leftover, shards)


def sharded_spec(spec: PartitionSpec, layout: ShardLayout) -> PartitionSpec:
    """``spec`` with ``layout.axes`` appended to the entry of ``layout.dim``."""
    if layout.dim is None:
        return spec
    entries = list(spec) + [None] * max(0, layout.dim + 1 - len(spec))
    entry = entries[layout.dim]
    held = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    combined = (*held, *layout.axes)
    entries[layout.dim] = combined[0] if len(combined) == 1 else combined
    return PartitionSpec(*entries)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


@dataclass(frozen=True)
class ZeroLayout:
    """Where each parameter's shards lie, for ``stage`` (1 or 3) on a mesh of
    ``mesh_axes``; trees in the parameters' pure-dict structure."""

    stage: int
    layouts: PyTree  # a ShardLayout per parameter
    model_specs: PyTree  # the gathered parameters' specs: what the model computes with
    specs: PyTree  # the state's: each parameter's shards
    gather_dtypes: PyTree  # the dtype each parameter is gathered in (a name)
    # Where the trees hold the blocks: the model's ``blocks`` (by layer) or a pipeline's
    # ``stage_blocks`` (by chunk position, :mod:`jaxmoe.pipeline.params`).
    blocks_key: str = "blocks"
    # The dtype a gather's derivative reduce-scatters the gradient in (a name; the
    # reduced shard is cast back to the parameter's dtype), or None: the parameter's own.
    # Where the gathers are differentiated: stage 3 (``train.grad_reduce_dtype``).
    reduce_dtype: str | None = None

    def unit(self, tree: PyTree, index: int | None) -> PyTree:
        """The part of ``tree`` (laid out like the parameters) of block ``index``, or with
        None, the parameters outside the blocks (with the blocks left out)."""
        if index is not None:
            return tree[self.blocks_key][index]
        return {key: value for key, value in tree.items() if key != self.blocks_key}

    def units(self, tree: PyTree) -> list[tuple[str, int | None]]:
        """The gather units of ``tree``: the parameters outside the blocks, then each
        block (a layer, or a pipeline's chunk position), as ``(name, index)``."""
        prefix = "layer" if self.blocks_key == "blocks" else "chunk_layer"
        blocks = tree.get(self.blocks_key, {})
        return [(OUTSIDE_BLOCKS, None)] + [(f"{prefix}_{index}", index) for index in blocks]


def zero_layout(
    stage: int,
    shapes: PyTree,
    model_specs: PyTree,
    mesh_axes: MeshAxes,
    gather_dtypes: PyTree | None = None,
    reduce_dtype: str | None = None,
) -> ZeroLayout:
    """The plan for parameters of ``shapes`` (arrays or ShapeDtypeStructs) laid out by
    ``model_specs``; ``gather_dtypes`` default to each parameter's own dtype, and so does
    the dtype of their gradients' reduce-scatters (``reduce_dtype``)."""
    if stage not in (1, 3):
        raise ValueError(f"ZeRO stage {stage}: 1 or 3")
    layouts = jax.tree.map(
        lambda shape, spec: shard_layout(shape.shape, spec, mesh_axes),
        shapes,
        model_specs,
    )
    specs = jax.tree.map(sharded_spec, model_specs, layouts, is_leaf=_is_spec)
    if gather_dtypes is None:
        gather_dtypes = jax.tree.map(lambda shape: jnp.dtype(shape.dtype).name, shapes)
    return ZeroLayout(stage, layouts, model_specs, specs, gather_dtypes, reduce_dtype=reduce_dtype)


# ---------------------------------------------------------------------------------------
# Flat buffers: a device's block <-> rows of its shards, one row per device of the group.


def _to_rows(block: jax.Array, layout: ShardLayout) -> jax.Array:
    """A device's block -> ``[shards, shard size]``: row i is shard i, flattened."""
    dim, shards = layout.dim, layout.shards
    assert dim is not None
    shape = block.shape
    split = block.reshape(*shape[:dim], shards, shape[dim] // shards, *shape[dim + 1 :])
    return jnp.moveaxis(split, dim, 0).reshape(shards, -1)


def _split(flat: jax.Array, shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
    parts, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        parts.append(flat[..., offset : offset + size].reshape(*flat.shape[:-1], *shape))
        offset += size
    return parts


def _reduce_scatter(
    blocks: Sequence[jax.Array],
    layouts: Sequence[ShardLayout],
    axes: tuple[str, ...],
    dtype,
) -> list[jax.Array]:
    """Per-device blocks with one set of axes -> each summed over ``axes`` and cut to this
    device's shards, through one psum_scatter (in ``dtype``)."""
    pairs = list(zip(blocks, layouts, strict=True))
    rows = jnp.concatenate([_to_rows(block.astype(dtype), layout) for block, layout in pairs], 1)
    flat = jax.lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=True)[0]
    shapes = [layout.shard_shape(block.shape) for block, layout in pairs]
    return _split(flat, shapes)


# The name of the custom_vjp function of a parameter's gather, as its equation shows it
# (the rematerialisation policy of jaxmoe.parallel.fsdp knows the gathers by it).
GATHER_NAME = "gather_shards"


def gather_param(
    shard: jax.Array,
    layout: ShardLayout,
    dtype: str,
    scope: str,
    reduce_dtype: str | None = None,
) -> jax.Array:
    """One parameter's shard -> the device's block, in ``dtype``: one all_gather (tiled)
    whose output is the parameter the model reads. Its derivative reduce-scatters the
    cotangent in ``reduce_dtype`` (default: the shard's own, float32, as the plain step
    sums gradients) and casts the reduced shard to the shard's dtype."""
    if not layout.axes:
        return shard.astype(dtype)
    axes, dim = layout.axes, layout.dim

    def gather_shards(x: jax.Array) -> jax.Array:
        with jax.named_scope(f"{GATHER_SCOPE}/{scope}"):
            return jax.lax.all_gather(x.astype(dtype), axes, axis=dim, tiled=True)

    def forward(x: jax.Array) -> tuple[jax.Array, None]:
        return gather_shards(x), None

    def backward(_: None, cotangent: jax.Array) -> tuple[jax.Array]:
        with jax.named_scope(f"grad_reduce/{scope}"):
            summed = cotangent.astype(reduce_dtype or shard.dtype)
            reduced = jax.lax.psum_scatter(summed, axes, scatter_dimension=dim, tiled=True)
            return (reduced.astype(shard.dtype),)

    gather = jax.custom_vjp(gather_shards)
    gather.defvjp(forward, backward)
    return gather(shard)


def gather_params(
    shards: PyTree,
    layouts: PyTree,
    dtypes: PyTree,
    scope: str,
    reduce_dtype: str | None = None,
) -> PyTree:
    """Per device: the parameters of one unit (``shards`` in the plan's layout) gathered
    over their replicas, each in its gather dtype, one all_gather each (see the module
    docstring). Inside a shard_map over the whole mesh; differentiable, each gradient
    reduce-scattered in ``reduce_dtype`` (default: its parameter's)."""
    return jax.tree.map(
        lambda shard, layout, dtype: gather_param(shard, layout, dtype, scope, reduce_dtype),
        shards,
        layouts,
        dtypes,
    )


def gather_axes(layouts: PyTree) -> frozenset[tuple[str, ...]]:
    """The axes of the gathers of the parameters of ``layouts``."""
    return frozenset(layout.axes for layout in jax.tree.leaves(layouts) if layout.axes)


def gather_outside_blocks(shards: PyTree, plan: ZeroLayout) -> PyTree:
    """The parameters outside the blocks gathered; the blocks' left as shards (ZeRO-3)."""
    outside = gather_params(
        plan.unit(shards, None),
        plan.unit(plan.layouts, None),
        plan.unit(plan.gather_dtypes, None),
        OUTSIDE_BLOCKS,
        plan.reduce_dtype,
    )
    return {**outside, "blocks": shards["blocks"]} if "blocks" in shards else outside


def gather_all(shards: PyTree, plan: ZeroLayout) -> PyTree:
    """Every parameter gathered, unit by unit: those outside the blocks, then each block
    (ZeRO-1's gathers at the start of the step)."""
    gathered = {
        index: gather_params(
            plan.unit(shards, index),
            plan.unit(plan.layouts, index),
            plan.unit(plan.gather_dtypes, index),
            name,
        )
        for name, index in plan.units(shards)
    }
    outside = gathered.pop(None)
    return {**outside, plan.blocks_key: gathered} if plan.blocks_key in shards else outside


# ---------------------------------------------------------------------------------------
# Gradient synchronisation: whole gradients (ZeRO-1) or shards (ZeRO-3) -> reduced shards.


def reduce_scatter_gradients(grads: PyTree, layouts: PyTree) -> PyTree:
    """ZeRO-1's ``allreduce``: each gradient (the device's whole block) reduce-scattered
    over the axes it is sharded on, then summed over the axes it stays replicated on."""

    def reduce(path, grad, layout: ShardLayout):
        with jax.named_scope("grad_reduce/" + path_name(path)):
            if layout.axes:
                grad = jax.lax.psum_scatter(
                    grad, layout.axes, scatter_dimension=layout.dim, tiled=True
                )
            return jax.lax.psum(grad, layout.leftover) if layout.leftover else grad

    return jax.tree_util.tree_map_with_path(reduce, grads, layouts)


def sum_leftover(grads: PyTree, layouts: PyTree) -> PyTree:
    """ZeRO-3's ``allreduce``: shard gradients (already reduce-scattered by the gathers'
    derivatives) summed over the axes their parameters stay replicated on."""

    def reduce(path, grad, layout: ShardLayout):
        if not layout.leftover:
            return grad
        with jax.named_scope("grad_reduce/" + path_name(path)):
            return jax.lax.psum(grad, layout.leftover)

    return jax.tree_util.tree_map_with_path(reduce, grads, layouts)


def bucketed_gradients(grads: PyTree, layouts: PyTree, bucket_bytes: int, whole: bool) -> PyTree:
    """``bucketed`` under ZeRO: gradients with the same shard axes, leftover axes and
    dtype fused, in reverse parameter order, into buckets of at most ``bucket_bytes``
    (:func:`~jaxmoe.parallel.grad_sync.bucketed.plan_buckets`); each bucket is one
    psum_scatter of its rows of shards (``whole``: ZeRO-1's whole gradients), then one
    psum over the leftover axes. Each element is summed as :func:`reduce_scatter_gradients`
    (or :func:`sum_leftover`) sums it."""
    leaves, treedef = jax.tree.flatten(grads)
    layout_leaves = treedef.flatten_up_to(layouts)
    keys = []
    for layout in layout_leaves:
        axes = layout.axes if whole else ()
        keys.append((axes, layout.leftover) if axes or layout.leftover else ())
    out = list(leaves)
    for number, bucket in enumerate(plan_buckets(leaves, keys, bucket_bytes)):
        axes, leftover = bucket.axes
        members = bucket.leaves
        with jax.named_scope(f"grad_reduce/bucket{number}"):
            if axes:
                shards = _reduce_scatter(
                    [leaves[i] for i in members],
                    [layout_leaves[i] for i in members],
                    axes,
                    leaves[members[0]].dtype,
                )
            else:
                shards = [leaves[i] for i in members]
            if leftover:
                flat = jnp.concatenate([shard.ravel() for shard in shards])
                shards = _split(jax.lax.psum(flat, leftover), [s.shape for s in shards])
        for i, shard in zip(members, shards, strict=True):
            out[i] = shard
    return jax.tree.unflatten(treedef, out)


def sync_gradients(grads: PyTree, plan: ZeroLayout, algorithm: str, bucket_bytes: int) -> PyTree:
    """The step's gradient synchronisation under ZeRO: ``grads`` (whole blocks for stage 1,
    shards for stage 3) -> the reduced shards the optimizer applies."""
    whole = plan.stage == 1
    if algorithm == "bucketed":
        return bucketed_gradients(grads, plan.layouts, bucket_bytes, whole)
    if algorithm != "allreduce":
        raise ValueError(f"train.grad_sync={algorithm!r} does not compose with ZeRO")
    if whole:
        return reduce_scatter_gradients(grads, plan.layouts)
    return sum_leftover(grads, plan.layouts)


@dataclass(frozen=True)
class ZeroSync(GradSync):
    """The gradient synchronisation under ZeRO, behind the step's one interface: the
    gradients (whole blocks for stage 1, shards for stage 3) reduce-scattered onto the
    shards the optimizer updates (``allreduce`` or ``bucketed``; stateless)."""

    plan: ZeroLayout
    algorithm: str
    bucket_bytes: int

    def __post_init__(self) -> None:
        if self.algorithm not in ZERO_GRAD_SYNCS:
            raise ValueError(f"train.grad_sync={self.algorithm!r} does not compose with ZeRO")

    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        del specs, mesh_axes
        return Synced(sync_gradients(grads, self.plan, self.algorithm, self.bucket_bytes), state)
