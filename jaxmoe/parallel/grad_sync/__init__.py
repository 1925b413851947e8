"""Gradient synchronisation: how per-device gradients become the applied update.

One module per algorithm behind :class:`~jaxmoe.parallel.grad_sync.base.GradSync`;
``train.grad_sync`` names one of :data:`ALGORITHMS` (or ``auto``, resolved before
the step is built: :mod:`jaxmoe.plan.grad_sync_choice`).
"""

from __future__ import annotations

from jax.sharding import Mesh

from jaxmoe.config import TrainConfig
from jaxmoe.config.choices import GRAD_SYNCS
from jaxmoe.parallel.grad_sync.allreduce import AllReduce
from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, Synced
from jaxmoe.parallel.grad_sync.bucketed import Bucketed
from jaxmoe.parallel.grad_sync.decentralized import Decentralized
from jaxmoe.parallel.grad_sync.decentralized_int8 import DecentralizedInt8
from jaxmoe.parallel.grad_sync.delayed import Delayed
from jaxmoe.parallel.grad_sync.hierarchical import Hierarchical, devices_per_host
from jaxmoe.parallel.grad_sync.int8 import Int8

# The names live in the config, which must be readable without importing JAX.
ALGORITHMS = GRAD_SYNCS
# Exact up to float rounding; the others change what is applied (see their modules).
EXACT = frozenset({"allreduce", "bucketed", "hierarchical"})


def make_grad_sync(train: TrainConfig, mesh: Mesh | None = None) -> GradSync:
    """The algorithm ``train.grad_sync`` names, with its settings from ``train``.

    ``mesh`` is needed to build the step of the algorithms that treat hosts apart
    (``hierarchical``, ``int8``, and the relaxed ones, whose workers are hosts); the
    state's shape and specs need no mesh.
    """
    if train.grad_sync == "auto":
        raise ValueError("train.grad_sync='auto' must be resolved first (grad_sync_choice)")

    # Host size: needed only to build the step (the state does not depend on it).
    per_host = train.grad_sync_devices_per_host
    if mesh is not None:
        per_host = devices_per_host(per_host, mesh)
    per_host = per_host or 1

    builders = {
        "allreduce": AllReduce,
        "bucketed": lambda: Bucketed(train.grad_bucket_bytes),
        "hierarchical": lambda: Hierarchical(train.grad_bucket_bytes, per_host),
        "int8": lambda: Int8(train.grad_bucket_bytes, per_host),
        "decentralized": lambda: Decentralized(train.grad_bucket_bytes, per_host),
        "decentralized-int8": lambda: DecentralizedInt8(train.grad_bucket_bytes, per_host),
        "delayed": lambda: Delayed(train.grad_bucket_bytes, per_host),
    }
    return builders[train.grad_sync]()


__all__ = ["ALGORITHMS", "EXACT", "GradSync", "MeshAxes", "Synced", "make_grad_sync"]
