"""Multi-host start-up: ``jax.distributed`` for explicit or auto-detected clusters.

A run is multi-process when a coordinator is given (``--coordinator HOST:PORT
--num-processes N --process-id I``) or when JAX's cluster auto-detection finds
one (SLURM, Open MPI, ...; ``--distributed auto``). On CPU the processes use
gloo collectives. The mesh then spans every process's devices; each process
builds only its own rows of a batch; process 0 alone writes files.

Failure behaviour. When a process dies, every survivor exits non-zero, in
one of three ways (:data:`PEER_FAILURE_SIGNS`), whichever comes first:

- a collective was moving data to or from the dead process: its connection
  breaks and gloo aborts at once ("gloo::EnforceNotMet ... Received data size
  doesn't match expected size ... collective mismatch": misleading wording for
  a dead peer);
- the coordination service misses its heartbeats for ``heartbeat_timeout_s``:
  the JAX runtime aborts with "Terminating process because the JAX distributed
  service detected fatal errors. This most likely indicates that another task
  died";
- a step hangs for longer than the step timeout (``jaxmoe.train.run_control``):
  exit status :data:`PEER_FAILURE_EXIT_CODE` with :data:`PEER_FAILURE_MESSAGE`.

The first two abort inside C++ (status 134), where Python cannot intercept
them. ``jaxmoe launch`` always adds its own line naming the failed process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from jaxmoe import exit_codes
from jaxmoe.config import ConfigError

PEER_FAILURE_EXIT_CODE = exit_codes.PEER_FAILURE
PEER_FAILURE_MESSAGE = (
    "jaxmoe: step {step} did not finish within {timeout:.0f} s; "
    "a peer process has probably failed, stopping"
)
# What a survivor prints when a peer died (see the module docstring), one per way.
PEER_FAILURE_SIGNS = (
    "gloo::EnforceNotMet",
    "another task died",
    "a peer process has probably failed",
)
# Environment variables through which JAX detects a cluster launcher.
_CLUSTER_ENVIRONMENT = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (all None: a single process)."""

    coordinator: str | None = None  # HOST:PORT of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False  # let JAX detect the cluster (SLURM, MPI, ...)
    heartbeat_timeout_s: int = 30

    def __post_init__(self) -> None:
        explicit = (self.coordinator, self.num_processes, self.process_id)
        if any(v is not None for v in explicit) and any(v is None for v in explicit):
            raise ConfigError(
                "--coordinator, --num-processes and --process-id go together: give all three"
            )
        if self.coordinator is not None and self.auto:
            raise ConfigError("give either --coordinator ... or --distributed auto, not both")
        if self.num_processes is not None:
            if self.num_processes < 1:
                raise ConfigError(f"--num-processes={self.num_processes}: must be >= 1")
            if not 0 <= self.process_id < self.num_processes:
                raise ConfigError(
                    f"--process-id={self.process_id}: must be in [0, {self.num_processes})"
                )
        if self.coordinator is not None and ":" not in self.coordinator:
            raise ConfigError(f"--coordinator={self.coordinator!r}: expected HOST:PORT")
        if self.heartbeat_timeout_s < 1:
            raise ConfigError("--heartbeat-timeout must be at least 1 second")

    @property
    def enabled(self) -> bool:
        return self.coordinator is not None or self.auto

    def process_count_hint(self) -> int:
        """Processes in the run, as far as is known before JAX starts."""
        if self.num_processes is not None:
            return self.num_processes
        for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
            if name in os.environ:
                return int(os.environ[name])
        return 1

    def process_index_hint(self) -> int:
        """This process's index, as far as is known before JAX starts (0 if unknown)."""
        if self.process_id is not None:
            return self.process_id
        for name in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
            if name in os.environ:
                return int(os.environ[name])
        return 0


def cluster_detected() -> bool:
    return any(name in os.environ for name in _CLUSTER_ENVIRONMENT)


def initialize(config: DistributedConfig) -> None:
    """Join the multi-process run described by ``config`` (nothing for one process)."""
    # JAX is imported here, not with the module: the command line imports this module
    # before it can install its stop signals, and importing JAX takes a second.
    import jax

    if not config.enabled:
        return
    # gloo is what runs collectives between CPU processes (a no-op setting on GPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if config.auto:
        jax.distributed.initialize(heartbeat_timeout_seconds=config.heartbeat_timeout_s)
    else:
        jax.distributed.initialize(
            coordinator_address=config.coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
            heartbeat_timeout_seconds=config.heartbeat_timeout_s,
        )
