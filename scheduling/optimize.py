"""``optimize``: the whole chain for a per-device step (capture, schedule, emit, report).

The top of the package: it imports every layer below and nothing imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh

from scheduling.costs.profiling import ProfiledCostModel
from scheduling.policy import ExperimentalOptions, SchedulePolicy
from scheduling.program.capture import capture
from scheduling.program.collective_purpose import AxisRoles
from scheduling.reports.describe import build_report
from scheduling.reports.report import ScheduleReport
from scheduling.runtime import transports
from scheduling.runtime.emit import ScheduledStep, emit
from scheduling.search.schedule import batch_inputs, cost_model, schedule


def optimize(
    step_fn: Callable[..., Any],
    *example_args: Any,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    policy: SchedulePolicy | str = "dw",
    donate_argnums: Sequence[int] = (),
    batch_argnums: Sequence[int] = (),
    axis_roles: AxisRoles | None = None,
    experimental: ExperimentalOptions | None = None,
) -> tuple[ScheduledStep, ScheduleReport]:
    """Schedule a per-device step for its whole mesh.

    ``step_fn`` is written per device (collectives with mesh axis names), as it
    would be passed to ``jax.shard_map(step_fn, mesh=mesh, in_specs=...,
    out_specs=..., check_vma=False)``. Returns the jit-compiled scheduled step,
    which computes exactly what that ``shard_map`` computes, and its report.

    ``batch_argnums`` names the arguments whose every leaf has the batch as its
    leading axis (per device); the partitioning policies cut the forward pass into
    chunks along it. ``axis_roles`` names the role each mesh axis plays in the
    attention and MoE layouts, for the report (default: each axis plays the role of
    its own name). ``experimental``: research options, for measuring and for checking
    exactness (:class:`~scheduling.policy.ExperimentalOptions`; default: none).
    """
    policy = SchedulePolicy(name=policy) if isinstance(policy, str) else policy
    experimental = experimental or ExperimentalOptions()
    experimental.check(policy)
    program = capture(step_fn, *example_args, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    cost = cost_model(policy, mesh, program)
    scheduled = schedule(program, policy, cost, batch_inputs(program, batch_argnums), experimental)
    if experimental.transport is not None:
        transport = experimental.transport(mesh)
    else:
        transport = transports.connect(policy.transport, mesh)
    step = emit(
        scheduled.graph,
        scheduled.order,
        donate_argnums=donate_argnums,
        transport=transport,
        xla_pin="groups" if experimental.xla_groups else policy.xla_pin,
        op_seconds=cost.seconds if policy.xla_latencies else None,
    )
    report = build_report(scheduled, cost, policy, program, axis_roles)
    if isinstance(cost, ProfiledCostModel):
        cost.profiler.save()
    return step, report
