"""The train step as the scheduling layer rewrites it (``schedule.name``).

``none`` is the plain ``jit`` of the whole-mesh ``shard_map``; any other
schedule hands the per-device step to :func:`scheduling.optimize`, which
returns an equivalent step and a report of what it overlapped. Experiments pass
research options (:class:`scheduling.ExperimentalOptions`) to
:func:`plan_train_step`; ``none`` with a transport of theirs goes through
:func:`scheduling.optimize` too: the original order, its all-to-alls synchronous over
the transport that the other schedules use (the emulated cluster's sockets), so that a
speedup over it is overlap, not a change of transport.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding

import scheduling
from jaxmoe.config.layout import AXIS_ROLES
from jaxmoe.parallel.mesh import token_spec
from jaxmoe.train.resolved import Run
from jaxmoe.train.state import TrainState, abstract_sharded_state
from jaxmoe.train.step import ShardedStep, build_train_step


def abstract_step_args(run: Run) -> tuple[TrainState, jax.ShapeDtypeStruct]:
    """Shapes, dtypes and shardings of ``(state, batch)``; nothing is allocated."""
    config, mesh = run.config, run.on_mesh
    batch = jax.ShapeDtypeStruct(
        (config.train.batch_size, config.model.seq_len + 1),
        jax.numpy.int32,
        sharding=NamedSharding(mesh, token_spec(mesh)),
    )
    return abstract_sharded_state(run), batch


def capture_train_step(run: Run) -> tuple[scheduling.Program, ShardedStep]:
    """The per-device train step as the scheduling layer sees it, and the step itself."""
    sharded = build_train_step(run)
    program = scheduling.capture(
        sharded.per_device,
        *abstract_step_args(run),
        mesh=run.on_mesh,
        in_specs=sharded.in_specs,
        out_specs=sharded.out_specs,
    )
    return program, sharded


@dataclass(frozen=True)
class TrainStep:
    """The train step for ``config.schedule.name``, before compilation."""

    step: Any  # a jit-wrapped function, or a scheduling.ScheduledStep
    example: tuple[Any, ...]  # abstract (state, batch)
    report: scheduling.ScheduleReport | None  # None for the plain jit (schedule 'none')

    def compile(self) -> Callable[..., Any]:
        """``(state, batch) -> (state, metrics)``, compiled ahead of the first call."""
        if self.report is None:
            return self.step.lower(*self.example).compile()
        return self.step.compile(*self.example)

    def stablehlo(self) -> str:
        return self.step.lower(*self.example).as_text()


def axis_roles() -> scheduling.AxisRoles:
    """The role each axis of the folded mesh plays in the attention and MoE layouts."""
    return scheduling.AxisRoles(dict(AXIS_ROLES))


def scheduled_train_step(
    run: Run, experimental: scheduling.ExperimentalOptions | None = None
) -> TrainStep:
    """The run's train step in the order ``schedule.name`` gives it (the plain ``jit`` for
    ``none``), with its report; ``experimental``: research options for the scheduling
    layer (experiments only; see the module)."""
    config, mesh = run.config, run.on_mesh
    sharded = build_train_step(run)
    example = abstract_step_args(run)
    own_transport = experimental is not None and experimental.transport is not None
    if config.schedule.name == "none" and not own_transport:
        return TrainStep(sharded.jit(), example, None)
    step, report = scheduling.optimize(
        sharded.per_device,
        *example,
        mesh=mesh,
        in_specs=sharded.in_specs,
        out_specs=sharded.out_specs,
        policy=run.policy,
        donate_argnums=sharded.donate_argnums,
        batch_argnums=sharded.batch_argnums,
        axis_roles=axis_roles(),
        experimental=experimental,
    )
    return TrainStep(step, example, report)
