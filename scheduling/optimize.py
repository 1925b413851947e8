"""``optimize``: capture, split, place, order and emit a whole training step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh

from scheduling.capture import Program, Value, capture
from scheduling.cost import CostModel, collective_wire_bytes
from scheduling.emit import ScheduledStep, emit
from scheduling.graph import Graph, Kind, Node, Role
from scheduling.link_model import CollectiveCurves
from scheduling.passes import Placement, order, schedule_dw, split_async
from scheduling.passes.batch_layout import BatchLayouts, analyze
from scheduling.passes.order import Schedule
from scheduling.passes.partition_forward import partition_program
from scheduling.passes.partition_search import (
    CHUNK_COUNTS,
    PartitionChoice,
    expert_pipelines,
    search,
)
from scheduling.passes.split_async import splittable
from scheduling.policy import PACKING_DW, PARTITIONING, SchedulePolicy
from scheduling.profiling import OpProfiler, ProfiledCostModel, is_local
from scheduling.report import CollectiveReport, PartitionReport, ScheduleReport
from scheduling.simulate import simulate
from scheduling.trace import chrome_trace


def optimize(
    step_fn: Callable[..., Any],
    *example_args: Any,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    policy: SchedulePolicy | str = "dw",
    donate_argnums: Sequence[int] = (),
    batch_argnums: Sequence[int] = (),
) -> tuple[ScheduledStep, ScheduleReport]:
    """Schedule a per-device step for its whole mesh.

    ``step_fn`` is written per device (collectives with mesh axis names), as it
    would be passed to ``jax.shard_map(step_fn, mesh=mesh, in_specs=...,
    out_specs=..., check_vma=False)``. Returns the jit-compiled scheduled step,
    which computes exactly what that ``shard_map`` computes, and its report.

    ``batch_argnums`` names the arguments whose every leaf has the batch as its
    leading axis (per device); the ``partition`` and ``lancet`` policies cut the
    forward pass into chunks along it.
    """
    policy = SchedulePolicy(name=policy) if isinstance(policy, str) else policy
    program = capture(step_fn, *example_args, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    cost = cost_model(policy, mesh)
    planned = plan(program, policy, cost, batch_inputs(program, batch_argnums))
    step = emit(
        planned.graph,
        planned.schedule,
        donate_argnums=donate_argnums,
        fallback_to_sync=policy.fallback_to_sync,
    )
    report = build_report(planned, cost, policy, program)
    if isinstance(cost, ProfiledCostModel):
        cost.profiler.save()
    return step, report


def cost_model(policy: SchedulePolicy, mesh: Mesh) -> CostModel:
    """The policy's cost model: analytic or measured ops; profile or measured links."""
    curves = None
    if policy.collective_curves is not None:
        curves = CollectiveCurves.load(policy.collective_curves)
    if policy.op_costs == "measured":
        # Fake CPU devices share the host's cores: time each op on all of them at once.
        shared_cores = jax.default_backend() == "cpu" and is_local(mesh)
        profiler = OpProfiler(policy.op_cost_cache, mesh=mesh if shared_cores else None)
        return ProfiledCostModel(policy.device_profile, dict(mesh.shape), profiler, curves)
    return CostModel(policy.device_profile, dict(mesh.shape), curves)


def batch_inputs(program: Program, batch_argnums: Sequence[int]) -> list[Value]:
    """The program inputs that are leaves of the arguments ``batch_argnums``."""
    leaves_per_arg = [child.num_leaves for child in program.in_tree.children()]
    values = []
    for arg in batch_argnums:
        if not 0 <= arg < len(leaves_per_arg):
            raise ValueError(f"batch_argnums: the step has no argument {arg}")
        offset = sum(leaves_per_arg[:arg])
        values.extend(program.inputs[offset : offset + leaves_per_arg[arg]])
    return values


class Plan(NamedTuple):
    graph: Graph  # of the program as rewritten (partitioned ranges included)
    schedule: Schedule
    partitions: list[PartitionChoice]


def plan(
    program: Program,
    policy: SchedulePolicy,
    cost: CostModel | None = None,
    batch_inputs: Sequence[Value] = (),
) -> Plan:
    """What ``policy`` makes of ``program``: its graph, order and partitioned ranges."""
    cost = cost_model(policy, program.mesh) if cost is None else cost
    if policy.name == "none":
        graph = Graph(program, split=lambda op: False)
        return Plan(graph, order(graph, Placement(), policy.max_live_bytes_growth), [])
    partitions: list[PartitionChoice] = []
    if policy.name in PARTITIONING:
        if not batch_inputs:
            raise ValueError(
                f"schedule {policy.name!r} partitions along the batch: pass batch_argnums, "
                "the arguments whose leaves have the batch as their leading axis"
            )
        layouts = analyze(program, batch_inputs)
        if policy.name == "expert_pipeline":
            partitions = expert_pipelines(program, layouts, policy.partition_chunks, cost.seconds)
        else:
            counts = CHUNK_COUNTS if policy.partition_chunks is None else (policy.partition_chunks,)
            partitions = search(program, layouts, cost.seconds, counts, policy.partition_always)
            if not policy.partition_always:
                partitions = _keep_what_pays(program, layouts, partitions, policy, cost)
        program = partition_program(program, layouts, [choice.plan for choice in partitions])
    graph, schedule, _ = _schedule(program, policy, cost)
    return Plan(graph, schedule, partitions)


def _schedule(
    program: Program, policy: SchedulePolicy, cost: CostModel
) -> tuple[Graph, Schedule, float]:
    """Split, place dW work (if the policy does), order; and the simulated step time."""
    graph = split_async(program, min_bytes=policy.async_min_bytes)
    seconds = node_seconds(cost)
    placement = schedule_dw(graph, seconds) if policy.name in PACKING_DW else Placement()
    schedule = order(graph, placement, policy.max_live_bytes_growth)
    timeline = simulate(graph, schedule.order, seconds)
    return graph, schedule, timeline.step_seconds


def _keep_what_pays(
    program: Program,
    layouts: BatchLayouts,
    choices: list[PartitionChoice],
    policy: SchedulePolicy,
    cost: CostModel,
) -> list[PartitionChoice]:
    """The ranges whose partition shortens the whole simulated step.

    The search scores each range on its own; in the whole step its chunked
    all-to-alls share the link with every other collective. Each range is dropped
    in turn if the step is estimated shorter without it; then all are dropped if
    together they do not beat the unpartitioned step.
    """

    def estimate(kept: list[PartitionChoice]) -> float:
        partitioned = partition_program(program, layouts, [choice.plan for choice in kept])
        return _schedule(partitioned, policy, cost)[2]

    if not choices:
        return []
    kept = list(choices)
    best = estimate(kept)
    for choice in choices:
        trial = [c for c in kept if c is not choice]
        seconds = estimate(trial)
        if seconds < best:
            kept, best = trial, seconds
    return kept if kept and best < estimate([]) else []


def node_seconds(cost: CostModel) -> Callable[[Node], float]:
    """Seconds of each graph node under ``cost`` (a done costs nothing), memoised."""
    memo: dict[int, float] = {}

    def seconds(node: Node) -> float:
        if node.role is Role.DONE:
            return 0.0
        if node.id not in memo:
            memo[node.id] = cost.seconds(node.op)
        return memo[node.id]

    return seconds


def build_report(
    planned: Plan, cost: CostModel, policy: SchedulePolicy, original: Program
) -> ScheduleReport:
    """The report of ``planned``; the baseline is ``original`` as captured."""
    graph, schedule = planned.graph, planned.schedule
    seconds = node_seconds(cost)
    timeline = simulate(graph, schedule.order, seconds)
    baseline_graph = Graph(original, split=lambda op: False)
    baseline = simulate(baseline_graph, list(range(len(baseline_graph.nodes))), node_seconds(cost))

    collectives = []
    for index, timing in enumerate(sorted(timeline.collectives.values(), key=lambda t: t.node)):
        node = graph.nodes[timing.node]
        placed = schedule.placement.windows.get(node.id, [])
        duration = seconds(node)
        collectives.append(
            CollectiveReport(
                index=index,
                kind=node.op.primitive,
                phase=node.op.phase.value,
                layer=node.op.layer,
                bytes=int(collective_wire_bytes(node.op, cost.axis_sizes)),
                estimated_seconds=duration,
                is_async=node.role is Role.START,
                placed_ops=[
                    f"{graph.nodes[n].op.primitive}@{graph.nodes[n].op.layer}" for n in placed
                ],
                placed_seconds=sum(seconds(graph.nodes[n]) for n in placed),
                overlap_seconds=max(0.0, duration - timing.stall),
            )
        )

    def where(node: Node) -> str:
        return f"{node.op.primitive}@{node.op.layer or '<top>'}"

    synchronous = [n for n in graph.nodes if n.op.is_collective and n.role is Role.COMPUTE]
    not_understood = sorted(
        {where(n) for n in graph.nodes if n.op.is_opaque}
        | {where(n) for n in synchronous if not splittable(n.op)}
    )
    kept_synchronous = sorted(where(n) for n in synchronous if splittable(n.op))
    placed_total = sum(len(nodes) for nodes in schedule.placement.windows.values())
    return ScheduleReport(
        policy=policy.name,
        profile=cost.profile.name + (", measured ops" if policy.op_costs == "measured" else ""),
        collectives=collectives,
        ops=len(graph.program.ops),
        compute_seconds=timeline.compute_seconds,
        communication_seconds=timeline.communication_seconds,
        step_seconds=timeline.step_seconds,
        baseline_step_seconds=baseline.step_seconds,
        dw_ops=sum(kind is Kind.BACKWARD_DW for kind in graph.kinds),
        dw_ops_placed=placed_total,
        forced_placements=len(schedule.placement.forced),
        withdrawn_placements=len(schedule.withdrawn),
        peak_live_bytes=schedule.peak_live_bytes,
        baseline_peak_live_bytes=schedule.baseline_peak_live_bytes,
        live_bytes_bound_exceeded=schedule.live_bytes_bound_exceeded,
        exposed_communication_seconds=timeline.exposed_communication_seconds,
        not_understood=not_understood,
        partitions=[_partition_report(original, choice) for choice in planned.partitions],
        kept_synchronous=kept_synchronous,
        trace=chrome_trace(graph, timeline, name=f"schedule {policy.name}"),
    )


def _partition_report(program: Program, choice: PartitionChoice) -> PartitionReport:
    plan = choice.plan
    first, last = program.ops[plan.begin], program.ops[plan.end - 1]
    # Layer and block ("layer_1/moe"), without the name scopes inside a block.
    layers = sorted({"/".join(program.ops[p].layer.split("/")[:2]) for p in plan.chunked} - {""})
    return PartitionReport(
        first_op=f"{first.index}:{first.primitive}@{first.layer or '<top>'}",
        last_op=f"{last.index}:{last.primitive}@{last.layer or '<top>'}",
        layers=layers,
        chunks=plan.n,
        ops=plan.end - plan.begin,
        chunked_ops=len(plan.chunked),
        deferred_ops=len(plan.deferred),
        estimated_seconds=choice.estimated_seconds,
        unpartitioned_seconds=choice.unpartitioned_seconds,
        estimated_gain_seconds=choice.estimated_gain_seconds,
    )
