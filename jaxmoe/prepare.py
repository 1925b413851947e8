"""From a parsed configuration to a run ready to start: the one preparation path.

:func:`prepare_run` builds the mesh once and resolves every automatic choice once
(``train.grad_sync auto``); what it returns is what the training loop, ``jaxmoe
schedule`` and the emulated cluster's host processes work from. Nothing after it
builds a mesh or resolves a choice again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from jaxmoe.config import Config
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
