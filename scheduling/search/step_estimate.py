"""The whole step, scheduled and simulated: how every choice of the search is scored.

A choice of partitioned ranges is judged by what it does to the whole step,
not to the range alone: the program is partitioned, split into start/done
pairs, dW work is packed into the backward all-to-all windows (where asked),
ordered and simulated. :class:`StepEstimates` memoises op costs and estimates
across the many candidates one search weighs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduling.costs.cost_model import CostModel
from scheduling.costs.simulate import Timeline, simulate
from scheduling.order.list_scheduler import Order, order
from scheduling.passes import Placement, schedule_dw, split_async
from scheduling.passes.decompose_exchange import decompose_program
from scheduling.passes.exchange_regions import DecomposedRegion
from scheduling.passes.pair_microbatches import pair_passes
from scheduling.passes.partition_forward import partition_program
from scheduling.passes.prefetch import prefetch_bounds
from scheduling.policy import SchedulePolicy
from scheduling.program.batch_layout import BatchLayouts
from scheduling.program.capture import Op, Program
from scheduling.program.graph import Graph, Node, Role
from scheduling.search.partition_search import PartitionChoice


def node_seconds(
    cost: CostModel | Callable[[Op], float], memo: dict[Op, float] | None = None
) -> Callable[[Node], float]:
    """Seconds of each graph node under ``cost`` (a done costs nothing), memoised per op."""
    op_seconds = cost.seconds if isinstance(cost, CostModel) else cost
    memo = {} if memo is None else memo

    def seconds(node: Node) -> float:
        if node.role is Role.DONE:
            return 0.0
        if node.op not in memo:
            memo[node.op] = op_seconds(node.op)
        return memo[node.op]

    return seconds


def estimate(graph: Graph, order: Order | Sequence[int], cost: CostModel) -> Timeline:
    """The simulated timeline of ``graph`` run in ``order`` (an
    :class:`~scheduling.order.list_scheduler.Order` or a list of node ids) under ``cost``,
    which prices the kernels of the graph's program (a partitioned one's its own) where it
    is bound to the program the graph was made from."""
    nodes = order.nodes if isinstance(order, Order) else list(order)
    return simulate(graph, nodes, node_seconds(cost.rebound(graph.program)))


def exposed_all_to_all(graph: Graph, timeline: Timeline) -> float:
    """Seconds the step waits on all-to-alls (their stalls in ``timeline``)."""
    return sum(
        timing.stall
        for node, timing in timeline.collectives.items()
        if graph.nodes[node].op.primitive == "all_to_all"
    )


@dataclass
class StepEstimate:
    """One candidate of the search, scheduled and simulated."""

    partitions: list[PartitionChoice]
    pack_dw: bool
    graph: Graph
    order: Order
    timeline: Timeline
    # Exchange regions decomposed (positions in the program after partitioning).
    decompositions: list[DecomposedRegion] = field(default_factory=list)

    @property
    def step_seconds(self) -> float:
        return self.timeline.step_seconds

    @property
    def exposed_all_to_all_seconds(self) -> float:
        return exposed_all_to_all(self.graph, self.timeline)

    @property
    def rank(self) -> tuple[float, float]:
        """Shorter step first; at equal steps, less exposed all-to-all."""
        return (self.step_seconds, self.exposed_all_to_all_seconds)


def schedule_program(
    program: Program,
    policy: SchedulePolicy,
    seconds: Callable[[Node], float],
    pack_dw: bool,
    force_dw: bool | None = None,
) -> tuple[Graph, Order, Timeline]:
    """Split, pair microbatches (where the policy does), place dW work (if ``pack_dw``:
    with pairing, into the windows no other microbatch fills; where forcing a window's
    last candidates into it overfills it, also without forcing, the shorter simulated
    step kept; ``force_dw``: forced or not, whatever the step), bound the gathers of
    sharded weights to a prefetch, order; and the simulated timeline. Each order is made
    twice: the second waits for each gradient reduction where the first's simulated link
    has finished it, not before the update (its operand is held until it is waited for)."""
    graph = split_async(program, min_bytes=policy.async_min_bytes)
    pairing = pair_passes(graph, seconds) if policy.pairs_microbatches else None
    priorities = pairing.priorities if pairing else None
    windows = pairing.unpaired if pairing else None
    earliest = prefetch_bounds(graph, seconds, policy.prefetch_lead)

    def ordered(placement: Placement) -> tuple[Order, Timeline]:
        growth = policy.max_live_bytes_growth
        nodes = order(graph, placement, growth, priorities, earliest)
        timeline = simulate(graph, nodes.nodes, seconds)
        waits = _waits(graph, nodes, timeline)
        if not waits:
            return nodes, timeline
        # As many withdrawn for the bound as the first order's, most likely.
        hint = nodes.withdrawn_for_bound
        nodes = order(graph, placement, growth, priorities, earliest, waits, hint)
        return nodes, simulate(graph, nodes.nodes, seconds)

    if not pack_dw:
        return graph, *ordered(Placement())
    if force_dw is not None:
        return graph, *ordered(schedule_dw(graph, seconds, windows, force=force_dw))
    forced = schedule_dw(graph, seconds, windows)
    best = ordered(forced)
    if _overfilled(graph, forced, seconds):
        unforced = ordered(schedule_dw(graph, seconds, windows, force=False))
        if unforced[1].step_seconds < best[1].step_seconds:
            best = unforced
    return graph, *best


def _waits(graph: Graph, ordered: Order, timeline: Timeline) -> dict[int, float]:
    """Where to wait for each deferrable collective (a gradient reduction): before the first
    computation of the program that ``timeline`` begins once its transfer has ended, not
    before the update, which would hold its operand to the end of the step."""
    moved = set(ordered.placement.window_of())
    begins = [
        (event.start, event.node)
        for event in timeline.events
        if event.stream == "compute"
        and not event.waiting
        and graph.nodes[event.node].role is Role.COMPUTE
        and event.node not in moved
    ]
    begins.sort()
    times = [start for start, _ in begins]
    waits = {}
    for start, timing in timeline.collectives.items():
        if start not in graph.deferrable or graph.nodes[start].role is not Role.START:
            continue
        at = bisect.bisect_left(times, timing.finished)
        if at < len(begins):
            waits[graph.nodes[start].partner] = float(begins[at][1])
    return waits


def _overfilled(graph: Graph, placement: Placement, seconds: Callable[[Node], float]) -> bool:
    """Whether the work forced into some window takes longer than its all-to-all."""
    return any(
        sum(seconds(graph.nodes[n]) for n in nodes if n in placement.forced)
        > seconds(graph.nodes[start])
        for start, nodes in placement.windows.items()
    )


class StepEstimates:
    """Estimates of one program under one policy and cost model, memoised by choice."""

    def __init__(
        self,
        program: Program,
        layouts: BatchLayouts | None,
        policy: SchedulePolicy,
        cost: CostModel,
        force_dw: bool | None = None,
    ):
        self.program = program
        self.layouts = layouts
        self.policy = policy
        self.force_dw = force_dw  # scheduling.policy.ExperimentalOptions.force_dw
        self.cost = cost
        self.seconds_of_op = cost.seconds
        self.seconds_of_chunk = cost.chunk_seconds
        self.seconds = node_seconds(cost)
        self._memo: dict[tuple, StepEstimate] = {}
        self._programs: dict[tuple, Program] = {}

    def partitioned(self, partitions: Sequence[PartitionChoice]) -> Program:
        """The program with ``partitions`` applied (memoised)."""
        key = tuple((c.cut.begin, c.cut.end, c.cut.n) for c in partitions)
        if key not in self._programs:
            program = self.program
            if partitions:
                assert self.layouts is not None, "partitioning needs the batch layouts"
                cuts = [choice.cut for choice in partitions]
                program = partition_program(self.program, self.layouts, cuts)
            self._programs[key] = program
        return self._programs[key]

    def __call__(
        self,
        partitions: Sequence[PartitionChoice],
        pack_dw: bool,
        decompositions: Sequence[DecomposedRegion] = (),
    ) -> StepEstimate:
        key = (
            tuple((c.cut.begin, c.cut.end, c.cut.n) for c in partitions),
            pack_dw,
            tuple(
                (d.begin, str(d.decomposition), d.decomposition.piece_axis) for d in decompositions
            ),
        )
        if key not in self._memo:
            program = self.partitioned(partitions)
            if decompositions:
                program = decompose_program(program, list(decompositions))
            # A partitioned program's kernels are its own: the model bound to it prices them.
            seconds = self.seconds
            if program is not self.program:
                seconds = node_seconds(self.cost.rebound(program))
            graph, ordered, timeline = schedule_program(
                program, self.policy, seconds, pack_dw, self.force_dw
            )
            self._memo[key] = StepEstimate(
                list(partitions), pack_dw, graph, ordered, timeline, list(decompositions)
            )
        return self._memo[key]

    def keep_what_pays(
        self, choices: Sequence[PartitionChoice], pack_dw: bool
    ) -> list[PartitionChoice]:
        """The ranges whose partition shortens the whole simulated step.

        The search scores each range on its own; in the whole step its chunked
        all-to-alls share the link with every other collective (and, with dW packing,
        the windows it leaves). Each range is dropped in turn if the step is estimated
        shorter without it; then all are dropped if together they do not beat the
        unpartitioned step.
        """
        if not choices:
            return []
        kept = list(choices)
        best = self(kept, pack_dw).step_seconds
        for choice in choices:
            trial = [c for c in kept if c is not choice]
            seconds = self(trial, pack_dw).step_seconds
            if seconds < best:
                kept, best = trial, seconds
        return kept if kept and best < self([], pack_dw).step_seconds else []
