"""From a parsed configuration to a run ready to start: the one preparation path.

:func:`prepare_run` builds the mesh once and resolves every automatic choice once
(``train.grad_sync auto``); what it returns is what the training loop, ``jaxmoe
schedule`` and the emulated cluster's host processes work from. Nothing after it
builds a mesh or resolves a choice again. :func:`start_process` is the whole start of
one process of a run: its CPU devices, the distributed runtime, then the preparation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from jaxmoe.config import Config
from jaxmoe.parallel.distributed import DistributedConfig, initialize
from jaxmoe.parallel.host_devices import ensure_host_devices
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.plan.grad_sync_choice import GradSyncChoice, resolve_grad_sync


@dataclass(frozen=True)
class PreparedRun:
    """A configuration with every automatic choice made, and the mesh it runs on."""

    config: Config
    mesh: Mesh
    # What train.grad_sync auto chose and why (None when the user named an algorithm).
    grad_sync_choice: GradSyncChoice | None = None


def prepare_run(config: Config, devices: Sequence[jax.Device] | None = None) -> PreparedRun:
    """The mesh of ``config`` over ``devices`` (default: every device of every process),
    and ``config`` with its automatic choices resolved on it."""
    mesh = build_mesh(config.parallel, devices)
    config, choice = resolve_grad_sync(config, mesh)
    return PreparedRun(config, mesh, choice)


def start_process(config: Config, distributed: DistributedConfig) -> PreparedRun:
    """This process's part of the run: the CPU platform's share of the mesh's devices
    (before JAX starts its backends), the distributed runtime, and the prepared run."""
    ensure_host_devices(config.parallel.num_devices // distributed.process_count_hint())
    initialize(distributed)
    return prepare_run(config)
