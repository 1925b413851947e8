"""The interface every gradient-synchronisation algorithm implements.

An algorithm runs per device, inside the train step's whole-mesh ``shard_map``,
after the backward pass: it turns this device's gradients (of its loss divided
by the number of token shards) into the gradients the optimizer applies, and
may carry state from one step to the next. That state lives in
``TrainState.grad_sync``, so it is sharded, donated and checkpointed like the
rest of the state.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

PyTree = Any
# Mesh axis name -> size, in mesh order.
MeshAxes = Mapping[str, int]


class Synced(NamedTuple):
    """What an algorithm hands back to the step."""

    grads: PyTree  # what the optimizer applies, laid out like the parameters
    state: PyTree  # the next step's ``TrainState.grad_sync``
    # A boolean scalar (the same on every device): whether to apply ``grads`` at all this
    # step; None means always.
    apply: jax.Array | None = None


class GradSync(abc.ABC):
    """A gradient-synchronisation algorithm; stateless ones keep the default (empty) state."""

    def init_state(self, params: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
        """The state before the first step, as global arrays (traced under ``jit``)."""
        del params, specs, mesh_axes
        return {}

    def state_specs(self, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
        """PartitionSpecs of :meth:`init_state`'s tree."""
        del specs, mesh_axes
        return {}

    @abc.abstractmethod
    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        """Per device: this device's gradients and state -> what to apply, and the next state."""

    def after_update(
        self, params: PyTree, step: jax.Array, specs: PyTree, mesh_axes: MeshAxes
    ) -> PyTree:
        """Per device: the parameters the optimizer just updated -> the step's parameters.
        The identity, except for algorithms whose replicas keep parameters of their own and
        mix them with their peers' (decentralized SGD); ``step`` is the step's index."""
        del step, specs, mesh_axes
        return params


def path_name(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(key, "key", key)) for key in path)


def local_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh_axes: MeshAxes) -> tuple:
    """The shape of one device's block of a global array of ``shape`` laid out by ``spec``."""
    local = list(shape)
    for dim, entry in enumerate(spec):
        if entry is not None:
            names = entry if isinstance(entry, tuple) else (entry,)
            local[dim] //= math.prod(mesh_axes[name] for name in names)
    return tuple(local)


def per_device_zeros(params: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
    """For each parameter, a zero array holding one copy of its local block per device."""
    devices = math.prod(mesh_axes.values())
    return jax.tree.map(
        lambda param, spec: jnp.zeros(
            (devices, *local_shape(param.shape, spec, mesh_axes)), param.dtype
        ),
        params,
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def per_device_specs(specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
    """Per-device state (one value per device, e.g. a quantisation residual) is stored as a
    global array with a leading axis of one entry per device, split over every mesh axis."""
    per_device = PartitionSpec(tuple(mesh_axes))
    return jax.tree.map(lambda _: per_device, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


class ErrorFeedback(GradSync):
    """State of the algorithms that carry each step's compression error into the next:
    one residual per device and parameter block (``error_feedback`` is a field of each
    subclass; tests turn it off to show what it is for)."""

    error_feedback: bool

    def init_state(self, params: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
        return {"residual": per_device_zeros(params, specs, mesh_axes)}

    def state_specs(self, specs: PyTree, mesh_axes: MeshAxes) -> PyTree:
        return {"residual": per_device_specs(specs, mesh_axes)}

    def with_residual(self, grads: PyTree, state: PyTree) -> PyTree:
        """This step's gradients plus the error carried from the last step."""
        if not self.error_feedback:
            return grads
        return jax.tree.map(lambda g, e: g + e[0], grads, state["residual"])
