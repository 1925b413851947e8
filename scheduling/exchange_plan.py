"""``comet`` and ``lancet+comet``: which exchange regions to decompose, and how.

COMET's adaptive assignment, by the cost model. For every recognised exchange
(``scheduling.passes.exchange_regions``), forward and backward, each
decomposition that applies (``rounds``, ``chunks:n``) is materialized and its
region alone is scheduled and simulated on the two streams; so is the region
undecomposed. The fastest decomposition is kept where it beats the
undecomposed region. Then the whole step decides, as for partitioned ranges:
each kept region is dropped in turn if the simulated step is shorter without
it, and all are dropped if together they do not beat none.

``lancet+comet`` takes the best (shortest simulated step, then least exposed
all-to-all) of: ``lancet``'s plan; ``comet`` with and without dW packing; and
the exchanges of ``lancet``'s partitioned program decomposed in the same way,
with its dW packing. Being among the candidates, neither ``lancet`` nor
``comet`` can be estimated faster than it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduling.capture import Op, Program
from scheduling.graph import Node
from scheduling.joint_plan import lancet_plan
from scheduling.passes import Placement, order, split_async
from scheduling.passes.decompose_exchange import materialize
from scheduling.passes.exchange_regions import Exchange, RegionPlan, plan_all
from scheduling.passes.partition_search import PartitionChoice
from scheduling.simulate import simulate
from scheduling.step_estimate import StepEstimate, StepEstimates

# Chunk counts tried for ``chunks`` decompositions (``rounds`` has one per group size).
EXCHANGE_CHUNKS = (2, 4, 8)


@dataclass
class ExchangeChoice:
    """One recognised exchange: what was estimated, and what was done with it."""

    exchange: Exchange
    layer: str
    phase: str
    undecomposed_seconds: float
    estimates: dict[str, float] = field(default_factory=dict)  # decomposition -> seconds
    plan: RegionPlan | None = None  # the decomposition kept, if any
    why: str = ""

    @property
    def best(self) -> str | None:
        return min(self.estimates, key=self.estimates.__getitem__) if self.estimates else None

    @property
    def estimated_gain_seconds(self) -> float:
        if not self.estimates:
            return 0.0
        return self.undecomposed_seconds - min(self.estimates.values())


def region_seconds(ops: Sequence[Op], program: Program, seconds: Callable[[Node], float]) -> float:
    """``ops`` alone, split, ordered and simulated on the two streams."""
    alone = dataclasses.replace(
        program,
        ops=[dataclasses.replace(op, index=i) for i, op in enumerate(ops)],
        inputs=[],
        outputs=[],
    )
    graph = split_async(alone)
    schedule = order(graph, Placement(), float("inf"))
    return simulate(graph, schedule.order, seconds).step_seconds


def choose_exchanges(
    program: Program,
    seconds: Callable[[Node], float],
    chunk_counts: Sequence[int],
    forced: str | None = None,
) -> list[ExchangeChoice]:
    """Every exchange of ``program`` with its best decomposition where it is estimated to pay;
    with ``forced`` (e.g. ``"rounds:8"``), that one wherever it applies."""
    choices = []
    for exchange, plans in plan_all(program, tuple(chunk_counts)).items():
        region = program.ops[exchange.dispatch : exchange.combine + 1]
        choice = ExchangeChoice(
            exchange,
            exchange.layer(program),
            exchange.phase(program).value,
            region_seconds(region, program, seconds),
        )
        by_name = {}
        for plan in plans:
            name = str(plan.decomposition)
            if name in by_name:  # the same count along another axis: keep the first (longest)
                continue
            by_name[name] = plan
            choice.estimates[name] = region_seconds(
                materialize(program, plan, {}), program, seconds
            )
        if forced is not None:
            choice.plan = by_name.get(forced)
            choice.why = "forced" if choice.plan else f"{forced} does not apply"
        elif not plans:
            choice.why = (
                "not decomposable: an op between its all-to-alls has no rule for the pieces"
            )
        elif min(choice.estimates.values()) < choice.undecomposed_seconds:
            choice.plan = by_name[choice.best]
        else:
            choice.why = "every decomposition is estimated slower than the region as it is"
        choices.append(choice)
    return choices


def decompose(
    estimates: StepEstimates,
    partitions: Sequence[PartitionChoice],
    pack_dw: bool,
    choices: Sequence[ExchangeChoice] | None = None,
    forced: str | None = None,
) -> tuple[StepEstimate, list[ExchangeChoice]]:
    """The exchanges of the (partitioned) program decomposed where the whole step gains
    (with ``forced``, that decomposition wherever it applies, whatever the estimates).

    ``choices``: the exchanges' region estimates, when already made for this program.
    """
    if choices is None:
        program = estimates.partitioned(partitions)
        choices = choose_exchanges(program, estimates.seconds, EXCHANGE_CHUNKS, forced)
    choices = [dataclasses.replace(choice) for choice in choices]
    if forced is not None:
        plans = [c.plan for c in choices if c.plan is not None]
        return estimates(partitions, pack_dw, plans), choices
    kept = [c for c in choices if c.plan is not None]
    best = estimates(partitions, pack_dw, [c.plan for c in kept])
    for choice in list(kept):
        trial = [c for c in kept if c is not choice]
        estimate = estimates(partitions, pack_dw, [c.plan for c in trial])
        if estimate.rank < best.rank:
            kept, best = trial, estimate
            choice.why = "the whole step is estimated shorter without it"
    plain = estimates(partitions, pack_dw)
    if kept and plain.rank <= best.rank:
        for choice in kept:
            choice.why = "together the decompositions do not shorten the whole step"
        kept, best = [], plain
    for choice in choices:
        if choice not in kept:
            choice.plan = None
    return best, choices


def comet_plan(
    estimates: StepEstimates, forced: str | None = None
) -> tuple[StepEstimate, list[ExchangeChoice]]:
    """``async`` plus the exchanges decomposed (no partitioned ranges, no dW packing)."""
    return decompose(estimates, [], pack_dw=False, forced=forced)


def lancet_comet_plan(
    estimates: StepEstimates, counts: Sequence[int], forced: str | None = None
) -> tuple[StepEstimate, list[ExchangeChoice]]:
    """The best of ``lancet``, ``comet`` (with and without dW) and the two composed; with
    ``forced``, ``lancet``'s plan with every exchange left decomposed that way."""
    lancet = lancet_plan(estimates, counts)
    if forced is not None:
        return decompose(estimates, lancet.partitions, lancet.pack_dw, forced=forced)
    alone = choose_exchanges(estimates.program, estimates.seconds, EXCHANGE_CHUNKS)
    candidates = [
        (lancet, []),
        decompose(estimates, [], pack_dw=False, choices=alone),
        decompose(estimates, [], pack_dw=True, choices=alone),
    ]
    if lancet.partitions:
        candidates.append(decompose(estimates, lancet.partitions, lancet.pack_dw))
    return min(candidates, key=lambda candidate: candidate[0].rank)
