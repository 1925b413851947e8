"""Sharding rules for parameters, derived from their variable types.

Expert weights are declared as :class:`ExpertParam`; their leading axis is the
expert index and is sharded over the ``expert`` mesh axis. Every other
parameter is replicated. From a parameter's spec follow both its layout and
its gradient reduction: a gradient is summed over every mesh axis that the
parameter is *not* sharded over (replicated: data and expert; experts: data).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxmoe.parallel.mesh import EXPERT_AXIS, MESH_AXES

PyTree = Any


class ExpertParam(nnx.Param):
    """A parameter whose leading axis indexes experts; sharded over the expert axis."""


def param_specs(state: nnx.State) -> dict:
    """PartitionSpecs for the pure-dict form of ``state`` (see ``nnx.to_pure_dict``)."""

    def spec(variable: nnx.Variable) -> PartitionSpec:
        return PartitionSpec(EXPERT_AXIS) if isinstance(variable, ExpertParam) else PartitionSpec()

    specs = jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(specs)


def sharded_axes(spec: PartitionSpec) -> frozenset[str]:
    """The mesh axes a spec shards over."""
    axes: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return frozenset(axes)


def replicated_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """Mesh axes a parameter is replicated over: where its gradient must be summed."""
    sharded = sharded_axes(spec)
    return tuple(axis for axis in MESH_AXES if axis not in sharded)


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
