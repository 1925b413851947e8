"""From a parsed configuration to a run ready to start: the one preparation path.

:func:`prepare_run` builds the mesh once, makes every automatic choice once
(``train.grad_sync auto``) and resolves the configuration on that mesh
(:func:`jaxmoe.train.resolved.resolve`); the :class:`~jaxmoe.train.resolved.Run` it
returns is what the training loop, ``jaxmoe schedule`` and the emulated cluster's host
processes work from. Nothing after it builds a mesh, makes a choice or derives a plan
again. :func:`start_process` is the whole start of one process of a run: its CPU
devices, the distributed runtime, then the preparation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from jaxmoe.config import Config
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.parallel.distributed import DistributedConfig, initialize
from jaxmoe.parallel.host_devices import ensure_host_devices, ensure_xla_flags, xla_flags_for
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.plan.grad_sync_choice import resolve_grad_sync
from jaxmoe.train.resolved import Run, resolve


def prepare_run(
    config: Config,
    devices: Sequence[jax.Device] | None = None,
    *,
    mesh: Mesh | None = None,
    experimental: ExperimentalOptions = DEFAULT,
) -> Run:
    """``config`` resolved on its mesh over ``devices`` (default: every device of every
    process), or on ``mesh`` when one is given, its automatic choices made on it;
    ``experimental``: an experiment's research options (:mod:`jaxmoe.experimental`)."""
    if mesh is None:
        mesh = build_mesh(config.parallel, devices)
    config, choice = resolve_grad_sync(config, mesh)
    return resolve(config, mesh, choice, experimental)


def start_process(config: Config, distributed: DistributedConfig) -> Run:
    """This process's part of the run: the CPU platform's share of the mesh's devices and
    what XLA:GPU needs of the run (before JAX starts its backends), the distributed
    runtime, and the prepared run."""
    ensure_host_devices(config.parallel.num_devices // distributed.process_count_hint())
    ensure_xla_flags(xla_flags_for(config))
    initialize(distributed)
    return prepare_run(config)
