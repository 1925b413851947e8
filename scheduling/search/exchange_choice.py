"""``comet`` and ``lancet+comet``: which exchange regions to decompose, and how.

COMET's adaptive assignment, by the cost model, per MoE layer. For the
recognised exchanges of a layer (``scheduling.passes.exchange_regions``),
forward and backward, each decomposition that applies (``rounds``,
``chunks:n``), on all of them, on the forward ones only and on the backward
ones only, is materialized and each region alone is scheduled and simulated on
the two streams; so are the regions undecomposed. The fastest candidate is
kept where it beats the undecomposed layer. Then the whole step decides, as
for partitioned ranges: each kept layer is dropped in turn if the simulated
step is shorter without it, and all are dropped if together they do not beat
none.

``lancet+comet`` takes the best (shortest simulated step, then least exposed
all-to-all) of: ``lancet``'s choice; ``comet``'s, without and with dW packing;
and the exchanges of ``lancet``'s partitioned program decomposed in the same
way, with its dW packing. Being among the candidates, neither ``lancet`` nor
``comet`` can be estimated faster than it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduling.costs.simulate import simulate
from scheduling.order.list_scheduler import order
from scheduling.passes import Placement, split_async
from scheduling.passes.decompose_exchange import materialize, values_needed_whole
from scheduling.passes.exchange_regions import DecomposedRegion, Exchange, all_decompositions
from scheduling.program.capture import Op, Program
from scheduling.program.graph import Node
from scheduling.search.joint_choice import best_lancet
from scheduling.search.partition_search import PartitionChoice
from scheduling.search.step_estimate import StepEstimate, StepEstimates

# Chunk counts tried for ``chunks`` decompositions (``rounds`` has one per group size).
EXCHANGE_CHUNKS = (2, 4, 8)


@dataclass
class ExchangeChoice:
    """One MoE layer's exchanges (forward and backward): what was estimated, what was done.

    The unit of choice is the layer: a backward region decomposed like the forward one
    takes the forward's residual pieces as they are (no reassembly), so the two are
    estimated together. Candidates are each decomposition applied to every exchange of
    the layer, to the forward ones only, and to the backward ones only.
    """

    layer: str
    exchanges: list[Exchange]
    phases: list[str]
    undecomposed_seconds: float  # the layer's regions alone, as captured, summed
    estimates: dict[str, float] = field(default_factory=dict)  # candidate -> seconds
    candidates: dict[str, list[DecomposedRegion]] = field(default_factory=dict, repr=False)
    chosen: str | None = None  # the candidate kept, if any
    why: str = ""

    @property
    def regions(self) -> list[DecomposedRegion]:
        """The layer's regions as decomposed (none where the layer was left whole)."""
        return [] if self.chosen is None else self.candidates[self.chosen]

    @property
    def best(self) -> str | None:
        return min(self.estimates, key=self.estimates.__getitem__) if self.estimates else None

    @property
    def estimated_seconds(self) -> float:
        return self.undecomposed_seconds if self.chosen is None else self.estimates[self.chosen]


def region_seconds(ops: Sequence[Op], program: Program, seconds: Callable[[Node], float]) -> float:
    """``ops`` alone, split, ordered and simulated on the two streams."""
    alone = dataclasses.replace(
        program,
        ops=[dataclasses.replace(op, index=i) for i, op in enumerate(ops)],
        inputs=[],
        outputs=[],
    )
    graph = split_async(alone)
    ordered = order(graph, Placement(), float("inf"))
    return simulate(graph, ordered.nodes, seconds).step_seconds


def regions_seconds(
    program: Program, regions: Sequence[DecomposedRegion], seconds: Callable[[Node], float]
) -> float:
    """The regions decomposed together (sharing pieces), each simulated alone, summed."""
    remap: dict = {}
    shared: dict = {}
    needed = values_needed_whole(program, regions)
    return sum(
        region_seconds(materialize(program, region, remap, shared, needed), program, seconds)
        for region in sorted(regions, key=lambda r: r.begin)
    )


def _subsets(exchanges: list[Exchange], program: Program) -> dict[str, list[Exchange]]:
    phases = {e.phase(program).value for e in exchanges}
    found = {"": exchanges}
    if len(phases) > 1:
        for phase in sorted(phases):
            found[f" ({phase} only)"] = [e for e in exchanges if e.phase(program).value == phase]
    return found


def choose_exchanges(
    program: Program,
    seconds: Callable[[Node], float],
    chunk_counts: Sequence[int],
    forced: str | None = None,
) -> list[ExchangeChoice]:
    """Every MoE layer's best decomposition where it is estimated to pay; with ``forced``
    (e.g. ``"rounds:8"``), that one on every exchange where it applies."""
    decompositions = all_decompositions(program, tuple(chunk_counts))
    layers: dict[str, list[Exchange]] = {}
    for exchange in decompositions:
        layers.setdefault(exchange.layer(program), []).append(exchange)
    choices = []
    for layer, exchanges in layers.items():
        undecomposed = sum(
            region_seconds(program.ops[e.dispatch : e.combine + 1], program, seconds)
            for e in exchanges
        )
        choice = ExchangeChoice(
            layer, exchanges, [e.phase(program).value for e in exchanges], undecomposed
        )
        names = {str(r.decomposition) for e in exchanges for r in decompositions[e]}
        for name in sorted(names):
            for suffix, subset in _subsets(exchanges, program).items():
                # The first region of that name per exchange (along the longest axis).
                picked = [
                    next((r for r in decompositions[e] if str(r.decomposition) == name), None)
                    for e in subset
                ]
                if any(r is None for r in picked) or (forced is not None and suffix):
                    continue
                rest = [e for e in exchanges if e not in subset]
                rest_seconds = sum(
                    region_seconds(program.ops[e.dispatch : e.combine + 1], program, seconds)
                    for e in rest
                )
                choice.candidates[name + suffix] = picked
                choice.estimates[name + suffix] = rest_seconds + regions_seconds(
                    program, picked, seconds
                )
        if forced is not None:
            choice.chosen = forced if forced in choice.candidates else None
            choice.why = "forced" if choice.chosen else f"{forced} does not apply"
        elif not choice.estimates:
            choice.why = (
                "not decomposable: an op between its all-to-alls has no rule for the pieces"
            )
        elif choice.estimates[choice.best] < undecomposed:
            choice.chosen = choice.best
        else:
            choice.why = "every decomposition is estimated slower than the layer as it is"
        choices.append(choice)
    return choices


def _regions(choices: Sequence[ExchangeChoice]) -> list[DecomposedRegion]:
    return [region for choice in choices for region in choice.regions]


def decompose(
    estimates: StepEstimates,
    partitions: Sequence[PartitionChoice],
    pack_dw: bool,
    choices: Sequence[ExchangeChoice] | None = None,
    forced: str | None = None,
) -> tuple[StepEstimate, list[ExchangeChoice]]:
    """The layers of the (partitioned) program decomposed where the whole step gains
    (with ``forced``, that decomposition wherever it applies, whatever the estimates).

    ``choices``: the layers' region estimates, when already made for this program.
    """
    if choices is None:
        program = estimates.partitioned(partitions)
        choices = choose_exchanges(program, estimates.seconds, EXCHANGE_CHUNKS, forced)
    choices = [dataclasses.replace(choice) for choice in choices]
    if forced is not None:
        return estimates(partitions, pack_dw, _regions(choices)), choices
    kept = [c for c in choices if c.chosen is not None]
    best = estimates(partitions, pack_dw, _regions(kept))
    for choice in list(kept):
        trial = [c for c in kept if c is not choice]
        estimate = estimates(partitions, pack_dw, _regions(trial))
        if estimate.rank < best.rank:
            kept, best = trial, estimate
            choice.why = f"{choice.chosen}: the whole step is estimated shorter without it"
    plain = estimates(partitions, pack_dw)
    if kept and plain.rank <= best.rank:
        for choice in kept:
            choice.why = f"{choice.chosen}: together the layers do not shorten the whole step"
        kept, best = [], plain
    for choice in choices:
        if choice not in kept:
            choice.chosen = None
    return best, choices


def best_comet(
    estimates: StepEstimates, forced: str | None = None
) -> tuple[StepEstimate, list[ExchangeChoice]]:
    """``async`` plus the exchanges decomposed (no partitioned ranges, no dW packing)."""
    return decompose(estimates, [], pack_dw=False, forced=forced)


def best_lancet_comet(
    estimates: StepEstimates, counts: Sequence[int], forced: str | None = None
) -> tuple[StepEstimate, list[ExchangeChoice]]:
    """The best of ``lancet``, ``comet`` (with and without dW) and the two composed; with
    ``forced``, ``lancet``'s choice with every exchange left decomposed that way."""
    lancet = best_lancet(estimates, counts)
    if forced is not None:
        return decompose(estimates, lancet.partitions, lancet.pack_dw, forced=forced)
    comet, layers = decompose(estimates, [], pack_dw=False)
    candidates = [
        (lancet, []),
        (comet, layers),
        # comet's layers with dW packed into the windows the decomposition leaves.
        (estimates([], True, comet.decompositions), layers),
        decompose(estimates, lancet.partitions, lancet.pack_dw),
    ]
    return min(candidates, key=lambda candidate: candidate[0].rank)
