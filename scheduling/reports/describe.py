"""What a schedule does, read off its simulated timeline: the schedule report.

Besides the totals, each collective's row says why its overlap is what it is:
how long it waited for the link and behind which class of collectives, how
much work the compute stream had between its start and its done (none: it is
awaited at once, nothing independent to run), and for a backward all-to-all
how much dW work was placed in its window.
"""

from __future__ import annotations

from scheduling.costs.cost_model import CostModel, collective_wire_bytes
from scheduling.costs.simulate import CollectiveTiming, Timeline, simulate
from scheduling.passes.split_async import splittable
from scheduling.policy import SchedulePolicy
from scheduling.program.capture import Phase, Program
from scheduling.program.collective_purpose import AxisRoles, collective_axes, collective_purposes
from scheduling.program.graph import Graph, Kind, Node, Role
from scheduling.reports.chrome_trace import chrome_trace
from scheduling.reports.report import (
    CollectiveReport,
    ExchangeReport,
    PartitionReport,
    ScheduleReport,
)
from scheduling.search.exchange_choice import ExchangeChoice
from scheduling.search.partition_search import PartitionChoice
from scheduling.search.schedule import Schedule
from scheduling.search.step_estimate import node_seconds

_TINY = 1e-12  # seconds: below this a duration is a rounding error


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def why(
    graph: Graph,
    timeline: Timeline,
    timing: CollectiveTiming,
    duration: float,
    placed_seconds: float | None,
) -> str:
    """Why a collective's overlap is what it is, in a few words."""
    node = graph.nodes[timing.node]
    if node.role is not Role.START:
        return "synchronous"
    reasons = []
    if timing.stall <= _TINY:
        reasons.append("hidden")
    queued = timing.began - timing.issued
    if queued > _TINY and timing.stall > _TINY:
        critical, deferrable = timeline.link_holders(timing.issued, timing.began)
        if deferrable > _TINY:
            reasons.append(f"link busy with gradient reductions {_ms(deferrable)}")
        if critical > _TINY:
            reasons.append(f"link busy with critical collectives {_ms(critical)}")
    window = timing.reached - timing.issued
    if timing.stall > _TINY:
        if window <= _TINY:
            reasons.append("no independent work")
        else:
            reasons.append(f"{_ms(window)} of work for {_ms(duration)} of transfer")
    if placed_seconds is not None:
        reasons.append(f"dW work placed: {_ms(placed_seconds)} of {_ms(duration)}")
    return "; ".join(reasons)


def build_report(
    scheduled: Schedule,
    cost: CostModel,
    policy: SchedulePolicy,
    original: Program,
    axis_roles: AxisRoles | None = None,
) -> ScheduleReport:
    """The report of ``scheduled``; the baseline is ``original`` as captured. Each
    collective's purpose is named with ``axis_roles`` (default: read off the axis names).
    ``cost`` prices ``original``'s kernels, as :func:`~scheduling.schedule` did."""
    graph, order = scheduled.graph, scheduled.order
    cost = cost.bound_to(original)
    purposes = collective_purposes(graph.program, axis_roles)
    seconds = node_seconds(cost.rebound(graph.program))  # a partitioned program's kernels
    timeline = simulate(graph, order.nodes, seconds)
    baseline_graph = Graph(original, split=lambda op: False)
    baseline = simulate(baseline_graph, list(range(len(baseline_graph.nodes))), node_seconds(cost))

    collectives = []
    for index, timing in enumerate(sorted(timeline.collectives.values(), key=lambda t: t.node)):
        node = graph.nodes[timing.node]
        placed = order.placement.windows.get(node.id, [])
        placed_seconds = sum(seconds(graph.nodes[n]) for n in placed)
        duration = seconds(node)
        is_window = node.op.primitive == "all_to_all" and node.op.phase is Phase.BACKWARD
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
                placed_seconds=placed_seconds,
                overlap_seconds=max(0.0, duration - timing.stall),
                deferrable=timing.deferrable,
                why=why(
                    graph,
                    timeline,
                    timing,
                    duration,
                    placed_seconds if is_window and node.role is Role.START else None,
                ),
                axes=list(collective_axes(node.op)),
                purpose=purposes.get(node.op, node.op.primitive),
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
    placed_total = sum(len(nodes) for nodes in order.placement.windows.values())
    return ScheduleReport(
        policy=policy.name,
        profile=cost.profile.name + (", measured ops" if policy.op_costs == "measured" else ""),
        collectives=collectives,
        ops=len(graph.program.ops),
        compute_seconds=timeline.compute_seconds,
        communication_seconds=timeline.communication_seconds,
        step_seconds=timeline.step_seconds,
        baseline_step_seconds=baseline.step_seconds,
        ideal_step_seconds=max(baseline.compute_seconds, baseline.communication_seconds),
        dw_ops=sum(kind is Kind.BACKWARD_DW for kind in graph.kinds),
        dw_ops_placed=placed_total,
        forced_placements=len(order.placement.forced),
        withdrawn_placements=len(order.withdrawn),
        peak_live_bytes=order.peak_live_bytes,
        baseline_peak_live_bytes=order.baseline_peak_live_bytes,
        live_bytes_bound_exceeded=order.live_bytes_bound_exceeded,
        exposed_communication_seconds=timeline.exposed_communication_seconds,
        not_understood=not_understood,
        partitions=[_partition_report(original, choice) for choice in scheduled.partitions],
        exchanges=[_exchange_report(choice) for choice in scheduled.exchanges],
        kept_synchronous=kept_synchronous,
        trace=chrome_trace(graph, timeline, name=f"schedule {policy.name}"),
    )


def _exchange_report(choice: ExchangeChoice) -> ExchangeReport:
    return ExchangeReport(
        layer=choice.layer,
        phases=choice.phases,
        decomposition=choice.chosen or "none",
        undecomposed_seconds=choice.undecomposed_seconds,
        estimated_seconds=choice.estimated_seconds,
        estimated_gain_seconds=choice.undecomposed_seconds - choice.estimated_seconds,
        candidates=dict(choice.estimates),
        why=choice.why,
    )


def _partition_report(program: Program, choice: PartitionChoice) -> PartitionReport:
    cut = choice.cut
    first, last = program.ops[cut.begin], program.ops[cut.end - 1]
    # Layer and block ("layer_1/moe"), without the name scopes inside a block.
    layers = sorted({"/".join(program.ops[p].layer.split("/")[:2]) for p in cut.chunked} - {""})
    return PartitionReport(
        first_op=f"{first.index}:{first.primitive}@{first.layer or '<top>'}",
        last_op=f"{last.index}:{last.primitive}@{last.layer or '<top>'}",
        layers=layers,
        chunks=cut.n,
        ops=cut.end - cut.begin,
        chunked_ops=len(cut.chunked),
        deferred_ops=len(cut.deferred),
        estimated_seconds=choice.estimated_seconds,
        unpartitioned_seconds=choice.unpartitioned_seconds,
        estimated_gain_seconds=choice.estimated_gain_seconds,
    )
