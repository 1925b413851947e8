"""``lancet``: partitioned ranges and dW packing chosen together, never worse than its parts.

Composing the passes one after the other (partition by its own estimate, then
pack dW into what windows remain) can lose to either pass alone: a range that
pays on its own may take the backward windows' work away, or chunk compute
that the dW packing would have hidden anyway. So every candidate is scored by
simulating the whole step with dW placed (``scheduling.search.step_estimate``):

- the choices of the parts: ``async`` (nothing), ``dw`` (no range), ``partition``
  (its ranges, chosen without dW) with and without dW packing;
- the joint search: the dynamic programme of ``partition_search`` restricted to
  each chunk count ``n`` and over all of them, and every legal range at the
  best seed's ``n``; the best of these seeds is refined by dropping ranges one at
  a time while the step, with dW placed, gets shorter.

The candidate kept is the one with the shortest simulated step, and among equal
steps the one with the least exposed all-to-all. Being among the candidates,
``async``, ``dw`` and ``partition`` can never be estimated faster than it.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.search.partition_search import RangeCandidate, candidates, choose
from scheduling.search.step_estimate import StepEstimate, StepEstimates


def best_partitioned(
    estimates: StepEstimates, counts: Sequence[int], always: bool = False, pack_dw: bool = False
) -> StepEstimate:
    """What the ``partition`` policy chooses: the search, then the ranges that pay in the
    whole step; with ``always``, every range that can be partitioned."""
    assert estimates.layouts is not None
    groups, found, unpartitioned = candidates(
        estimates.program,
        estimates.layouts,
        estimates.seconds_of_op,
        counts,
        estimates.seconds_of_chunk,
    )
    choices = choose(groups, found, unpartitioned, always)
    if not always:
        choices = estimates.keep_what_pays(choices, pack_dw)
    return estimates(choices, pack_dw)


def best_lancet(estimates: StepEstimates, counts: Sequence[int]) -> StepEstimate:
    """The best of the parts' choices and of the joint search (see the module docstring)."""
    assert estimates.layouts is not None
    groups, found, unpartitioned = candidates(
        estimates.program,
        estimates.layouts,
        estimates.seconds_of_op,
        counts,
        estimates.seconds_of_chunk,
    )
    partition = estimates.keep_what_pays(choose(groups, found, unpartitioned), pack_dw=False)
    parts = [
        estimates([], pack_dw=False),
        estimates([], pack_dw=True),
        estimates(partition, pack_dw=False),
        estimates(partition, pack_dw=True),
    ]

    def sized(n: int) -> list[RangeCandidate]:
        return [c for c in found if c.choice.cut.n == n]

    seeds = [estimates(choose(groups, found, unpartitioned), pack_dw=True)]
    seeds += [estimates(choose(groups, sized(n), unpartitioned), pack_dw=True) for n in counts]
    seeds = [seed for seed in seeds if seed.partitions]
    if seeds:
        best_n = min(seeds, key=lambda e: e.rank).partitions[0].cut.n
        everywhere = choose(groups, sized(best_n), unpartitioned, always=True)
        seeds.append(estimates(everywhere, pack_dw=True))
        seed = min(seeds, key=lambda e: e.rank)
        refined = estimates.keep_what_pays(seed.partitions, pack_dw=True)
        seeds.append(estimates(refined, pack_dw=True))
    return min(parts + seeds, key=lambda e: e.rank)
