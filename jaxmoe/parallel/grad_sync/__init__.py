"""Gradient synchronisation: how per-device gradients become the applied update.

One module per algorithm behind :class:`~jaxmoe.parallel.grad_sync.base.GradSync`;
``train.grad_sync`` names one of :data:`ALGORITHMS`.
"""

from __future__ import annotations

from jaxmoe.config import TrainConfig
from jaxmoe.parallel.grad_sync.allreduce import AllReduce
from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, Synced
from jaxmoe.parallel.grad_sync.bucketed import Bucketed
from jaxmoe.parallel.grad_sync.decentralized import Decentralized
from jaxmoe.parallel.grad_sync.delayed import Delayed
from jaxmoe.parallel.grad_sync.int8 import Int8

ALGORITHMS = ("allreduce", "bucketed", "int8", "decentralized", "delayed")


def make_grad_sync(train: TrainConfig) -> GradSync:
    """The algorithm ``train.grad_sync`` names, with its settings from ``train``."""
    builders = {
        "allreduce": AllReduce,
        "bucketed": lambda: Bucketed(train.grad_bucket_bytes),
        "int8": Int8,
        "decentralized": Decentralized,
        "delayed": Delayed,
    }
    return builders[train.grad_sync]()


__all__ = ["ALGORITHMS", "GradSync", "MeshAxes", "Synced", "make_grad_sync"]
