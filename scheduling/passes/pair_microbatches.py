"""Pair microbatches: run microbatch i+1's forward pass beside microbatch i's backward
pass, so that each one's collectives run under the other's computation.

Within one microbatch, router -> dispatch -> experts -> combine is a strict chain: an
all-to-all has little independent work to hide behind. A step that accumulates
gradients over microbatches holds independent chains: microbatch i+1's forward pass
does not depend on microbatch i's backward pass. This pass interleaves the two (the
1F1B steady state of one pipeline stage; Megatron-Core's combined 1F1B all-to-all
overlap and DeepSeek's DualPipe pair them by hand), for any model, from the program
alone.

A microbatch is the ops under a name scope ``microbatch_<i>``
(:data:`scheduling.names.MICROBATCH_SCOPE`), its forward and backward passes told
apart by the phase capture gives each op. The step runs forward 0, then each pair
(forward i+1 with backward i), then the last backward pass. Each pair's compute nodes
are merged in the order a two-stream simulation of the two chains gives: the compute
stream takes the next node of whichever chain can start it first, while the link
carries each chain's collectives as soon as their operands exist. The result is a
priority for every compute node (:func:`pair_priorities`), which the order pass uses
in place of program positions; collectives then start as early and finish as late as
ever, and the merged neighbours fill the windows between.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable

from scheduling import names
from scheduling.program.capture import Phase
from scheduling.program.graph import Graph, Node, Role

_MICROBATCH = re.compile("^" + names.MICROBATCH_SCOPE.format(r"(\d+)") + "(/|$)")


def microbatch_of(node: Node) -> int | None:
    """The microbatch a node belongs to (None: outside every microbatch)."""
    match = _MICROBATCH.match(node.op.name_stack)
    return None if match is None else int(match.group(1))


def microbatch_passes(graph: Graph) -> dict[tuple[int, Phase], list[int]]:
    """``(microbatch, FORWARD | BACKWARD) -> compute node ids`` in program order."""
    passes: dict[tuple[int, Phase], list[int]] = defaultdict(list)
    for node in graph.nodes:
        index = microbatch_of(node)
        if index is None or node.role is not Role.COMPUTE:
            continue
        if node.op.phase in (Phase.FORWARD, Phase.BACKWARD):
            passes[index, node.op.phase].append(node.id)
    return dict(passes)


def merge_chains(
    graph: Graph, first: list[int], second: list[int], seconds: Callable[[Node], float]
) -> list[int]:
    """The compute nodes of two independent chains, in the order one compute stream and
    one link would run them: each chain in its own program order, the next node taken
    from the chain that can start first (ties: ``first``)."""
    finish: dict[int, float] = {}  # compute node -> when it ends
    arrival: dict[int, float] = {}  # collective start -> when its result is there
    link_free = 0.0
    now = 0.0

    def ready_at(node: int) -> float:
        at = 0.0
        for pred in graph.preds[node]:
            pred_node = graph.nodes[pred]
            if pred_node.role is Role.DONE:
                at = max(at, arrival.get(pred_node.partner, 0.0))
            elif pred_node.role is Role.START:
                at = max(at, arrival.get(pred, 0.0))
            else:
                at = max(at, finish.get(pred, 0.0))
        return at

    def issue_collectives(after: int) -> None:
        nonlocal link_free
        for succ in graph.succs[after]:
            node = graph.nodes[succ]
            if node.role is not Role.START or succ in arrival:
                continue
            if any(p not in finish for p in graph.preds[succ]):
                continue
            issue = max(finish[p] for p in graph.preds[succ])
            link_free = max(link_free, issue) + seconds(node)
            arrival[succ] = link_free

    chains = [list(first), list(second)]
    merged = []
    while any(chains):
        candidates = [
            (max(now, ready_at(chain[0])), index) for index, chain in enumerate(chains) if chain
        ]
        start_at, index = min(candidates)
        node = chains[index].pop(0)
        now = start_at + seconds(graph.nodes[node])
        finish[node] = now
        merged.append(node)
        issue_collectives(node)
    return merged


def pair_priorities(graph: Graph, seconds: Callable[[Node], float]) -> dict[int, float] | None:
    """Priorities for the compute nodes of the paired microbatches (None with fewer than
    two microbatches): each pair's merged nodes spread over the program positions that
    the backward pass of the pair held, in merged order."""
    passes = microbatch_passes(graph)
    count = 1 + max((index for index, _ in passes), default=-1)
    if count < 2:
        return None
    priorities: dict[int, float] = {}
    for index in range(count - 1):
        backward = passes.get((index, Phase.BACKWARD), [])
        forward = passes.get((index + 1, Phase.FORWARD), [])
        if not backward or not forward:
            continue
        merged = merge_chains(graph, backward, forward, seconds)
        low, high = backward[0] - 0.5, backward[-1] + 0.5
        step = (high - low) / (len(merged) + 1)
        for rank, node in enumerate(merged, start=1):
            priorities[node] = low + rank * step
    return priorities


def unpaired_windows(graph: Graph) -> list[Node]:
    """The backward all-to-alls whose windows no forward pass fills: those of the last
    microbatch (and of any op outside the microbatches)."""
    passes = microbatch_passes(graph)
    last = max((index for index, _ in passes), default=None)
    return [start for start in graph.backward_all_to_alls() if microbatch_of(start) in (None, last)]
