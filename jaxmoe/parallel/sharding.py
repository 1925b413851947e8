"""Sharding rules for parameters, from the roles their dimensions are split over.

A parameter may carry ``parallel_axes`` metadata: for each dimension, the
role it is split over (``tensor``, ``expert``, ``expert_tensor``; see
:mod:`jaxmoe.config.layout`) or None; ``tensor_if_divides`` splits over the
tensor group only where the group's size divides the dimension, and replicates it
otherwise. :class:`ExpertParam` splits its leading axis
over ``expert`` unless it says more. Every other parameter is replicated. A
role becomes the mesh axes that form its group on the layout at hand, so one
model declaration shards correctly on every folded layout. From a
parameter's spec follow both its layout and its gradient reduction: a
gradient is summed over every mesh axis that the parameter is *not* split
over.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxmoe.config.layout import EXPERT, TENSOR_IF_DIVIDES, axes_for_role
from jaxmoe.parallel.mesh import DATA_AXIS, EXPERT_AXIS

PyTree = Any
# The mesh of the unfolded layout, for specs asked for outside any mesh.
DEFAULT_AXIS_NAMES = (DATA_AXIS, EXPERT_AXIS)


class ExpertParam(nnx.Param):
    """A parameter whose leading axis indexes experts; split over the expert group."""


def split_roles(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The role each dimension of ``variable`` is split over (None: not split)."""
    roles = variable.get_metadata().get("parallel_axes")
    if roles is not None:
        return tuple(roles)
    return (EXPERT,) if isinstance(variable, ExpertParam) else ()


def _current_axis_names() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return DEFAULT_AXIS_NAMES if mesh.empty else tuple(mesh.axis_names)


def _current_axis_sizes() -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    return dict.fromkeys(DEFAULT_AXIS_NAMES, 1) if mesh.empty else dict(mesh.shape)


def spec_for(
    roles: tuple[str | None, ...],
    axis_sizes: Mapping[str, int],
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """A PartitionSpec splitting each dimension over the mesh axes of its role, on a mesh
    of ``axis_sizes`` (name -> size, in mesh order), for a parameter of ``shape``."""
    entries = []
    for dimension, role in enumerate(roles):
        axes = axes_for_role(role, tuple(axis_sizes)) if role is not None else ()
        if role == TENSOR_IF_DIVIDES and shape is not None:
            group = 1
            for axis in axes:
                group *= axis_sizes[axis]
            if shape[dimension] % group:
                axes = ()
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def param_specs(state: nnx.State, axis_sizes: Mapping[str, int] | None = None) -> dict:
    """PartitionSpecs for the pure-dict form of ``state`` (see ``nnx.to_pure_dict``), on a
    mesh of ``axis_sizes`` (``mesh.shape``; default: the current mesh's, or the unfolded
    layout's)."""
    sizes = _current_axis_sizes() if axis_sizes is None else dict(axis_sizes)
    specs = jax.tree.map(
        lambda variable: spec_for(
            split_roles(variable), sizes, getattr(variable.get_value(), "shape", None)
        ),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.to_pure_dict(specs)


def sharded_axes(spec: PartitionSpec) -> frozenset[str]:
    """The mesh axes a spec shards over."""
    axes: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return frozenset(axes)


def replicated_axes(
    spec: PartitionSpec, axis_names: tuple[str, ...] | None = None
) -> tuple[str, ...]:
    """Mesh axes a parameter is replicated over: where its gradient must be summed.

    ``axis_names``: the mesh's (default: the current mesh's, or the unfolded layout's)."""
    sharded = sharded_axes(spec)
    names = _current_axis_names() if axis_names is None else axis_names
    return tuple(axis for axis in names if axis not in sharded)


def reduce_gradients(grads: PyTree, specs: PyTree) -> PyTree:
    """Sum per-device gradients over the axes each parameter is replicated on.

    Must run inside a manual (shard_map) region over the whole mesh. The
    per-device loss is pre-divided by the number of token shards, so the sum
    is the gradient of the global mean loss.
    """

    def reduce(path, grad, spec):
        # The scope names the parameter in the scheduler's report.
        with jax.named_scope("grad_reduce/" + "/".join(str(getattr(k, "key", k)) for k in path)):
            return jax.lax.psum(grad, replicated_axes(spec))

    return jax.tree_util.tree_map_with_path(reduce, grads, specs)


def global_norm(tree: PyTree, specs: PyTree) -> jax.Array:
    """L2 norm of a sharded tree, counting every element once across the mesh.

    Replicated leaves are counted from the local copy; sharded leaves contribute
    their local sum of squares, summed over the axes they are sharded on. One
    psum per distinct set of sharded axes.
    """
    squares_by_axes: dict[frozenset[str], jax.Array] = defaultdict(lambda: jnp.float32(0))
    for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs), strict=True):
        axes = sharded_axes(spec)
        squares_by_axes[axes] = squares_by_axes[axes] + jnp.sum(
            jnp.square(leaf.astype(jnp.float32))
        )
    total = jnp.float32(0)
    for axes, squares in squares_by_axes.items():
        total = total + (jax.lax.psum(squares, tuple(sorted(axes))) if axes else squares)
    return jnp.sqrt(total)
