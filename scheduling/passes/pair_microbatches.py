"""Pair microbatches: run every microbatch's forward and backward pass beside another
microbatch's pass, so that each one's collectives run under the other's computation.

Within one microbatch, router -> dispatch -> experts -> combine is a strict chain: an
all-to-all has little independent work to hide behind. A step that accumulates
gradients over microbatches holds independent chains: microbatch i+2's forward pass
does not depend on microbatch i's backward pass, nor microbatch 1's forward pass on
microbatch 0's. This pass interleaves pairs of them (Megatron-Core's combined 1F1B
all-to-all overlap and DeepSeek's DualPipe pair a forward with a backward pass by hand),
for any model, from the program alone.

A microbatch is the ops under a name scope ``microbatch_<i>``
(:data:`scheduling.names.MICROBATCH_SCOPE`), its forward and backward passes told
apart by the phase capture gives each op. A pipelined step has no such loop: its ticks
(:data:`scheduling.names.TICK_SCOPE`) each run a forward slot and a backward slot of
different microbatches, the 1F1B steady state. A tick's backward slot waits for its own
forward slot (on the last stage they are one microbatch's, and every stage runs the same
program), but not for the next tick's, so tick k's backward slot is paired with tick
k+1's forward slot.
With M microbatches the step runs the passes
in M + 1 pairs (:func:`pass_pairs`): forward 0 with forward 1, then backward i with
forward i+2, then backward M-2 with backward M-1, so that no pass runs alone (pairing
only backward i with forward i+1 leaves the first forward and the last backward pass
unpaired: a quarter of the all-to-alls with four microbatches). The cost is one more
microbatch's activations in flight. Each pair's compute nodes are merged in the order a
two-stream simulation of the two chains gives: the compute stream takes the next node of
whichever chain can start it first, and when both can, of the one nearer its next
collective, so that the collective is on the link while the other chain computes; the
link carries each chain's collectives as soon as their operands exist. (Without that
rule, ties going to one chain, the Lancet paper's GPT-2 MoE on 16 V100s hid 59% of the
exposed all-to-all instead of all of it.) The result is a priority for every compute node
(:func:`pair_passes`), which the order pass uses in place of program positions;
collectives then start as early and finish as late as ever, and the merged neighbours
fill the windows between. Work outside every pass that a paired node waits for (from
:data:`~scheduling.names.MICROBATCHES_IN_FLIGHT` times two microbatches on, the
gradients summed up to microbatch i - 3 and the barrier that lets microbatch i start) gets
the key of its first such reader: at its program position, after microbatch i - 1, it
would hold each pair's later pass until the earlier one had ended. The longer pass of a
pair runs on alone once the other has ended (a backward pass takes about twice its forward
pass): the backward all-to-alls of that tail, like those outside the microbatches, are
windows no other pass fills, and the dW work of :mod:`scheduling.passes.schedule_dw`
goes into them.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from scheduling import names
from scheduling.program.capture import Phase
from scheduling.program.graph import Graph, Node, Role

_MICROBATCH = re.compile("^" + names.MICROBATCH_SCOPE.format(r"(\d+)") + "(/|$)")
_TICK = re.compile("(^|/)" + names.TICK_SCOPE.format(r"(\d+)") + "(/|$)")


def microbatch_of(node: Node) -> int | None:
    """The microbatch a node belongs to (None: outside every microbatch)."""
    match = _MICROBATCH.match(node.op.name_stack)
    return None if match is None else int(match.group(1))


def tick_of(node: Node) -> int | None:
    """The pipeline tick a node belongs to (None: outside every tick)."""
    match = _TICK.search(node.op.name_stack)
    return None if match is None else int(match.group(2))


def microbatch_passes(
    graph: Graph, unit: Callable[[Node], int | None] = microbatch_of
) -> dict[tuple[int, Phase], list[int]]:
    """``(microbatch, FORWARD | BACKWARD) -> compute node ids`` in program order (with
    ``unit=tick_of``: a pipeline tick's forward and backward slots)."""
    passes: dict[tuple[int, Phase], list[int]] = defaultdict(list)
    for node in graph.nodes:
        index = unit(node)
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
    from the chain that can start first; when both can start, from the one that reaches
    its next collective sooner, so that the collective is on the link while the other
    chain computes (ties: ``first``)."""
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

    chains = [first, second]
    to_collective = [_to_next_collective(graph, chain, seconds) for chain in chains]
    heads = [0, 0]
    merged = []
    while any(head < len(chain) for head, chain in zip(heads, chains, strict=True)):
        candidates = [
            (max(now, ready_at(chain[head])), to_collective[index][head], index)
            for index, (head, chain) in enumerate(zip(heads, chains, strict=True))
            if head < len(chain)
        ]
        start_at, _, index = min(candidates)
        node = chains[index][heads[index]]
        heads[index] += 1
        now = start_at + seconds(graph.nodes[node])
        finish[node] = now
        merged.append(node)
        issue_collectives(node)
    return merged


def _to_next_collective(
    graph: Graph, chain: list[int], seconds: Callable[[Node], float]
) -> list[float]:
    """For each node of ``chain``: the compute seconds from it up to the first node that
    feeds a collective (inclusive; the rest of the chain where none does)."""
    remaining, after = [0.0] * len(chain), 0.0
    for index in reversed(range(len(chain))):
        node = chain[index]
        feeds = any(graph.nodes[s].role is Role.START for s in graph.succs[node])
        after = seconds(graph.nodes[node]) + (0.0 if feeds else after)
        remaining[index] = after
    return remaining


Pass = tuple[int, Phase]  # (microbatch, FORWARD | BACKWARD)


def pass_pairs(count: int) -> list[tuple[Pass, Pass]]:
    """The passes of ``count`` microbatches, paired in the order the step runs them."""
    if count < 2:
        return []
    forward, backward = Phase.FORWARD, Phase.BACKWARD
    return [
        ((0, forward), (1, forward)),
        *(((i, backward), (i + 2, forward)) for i in range(count - 2)),
        ((count - 2, backward), (count - 1, backward)),
    ]


@dataclass(frozen=True)
class Pairing:
    """How a step's passes run in pairs: a key for each compute node of a paired pass
    (and for the work outside the passes that one waits for), which the order uses in
    place of program positions; and the backward all-to-alls whose windows no other
    pass fills, for the dW work of :mod:`scheduling.passes.schedule_dw`."""

    priorities: dict[int, float]
    unpaired: list[Node]


def pair_passes(graph: Graph, seconds: Callable[[Node], float]) -> Pairing | None:
    """The pairing of ``graph``'s passes (None where nothing pairs: fewer than two
    microbatches, no pipeline tick followed by a forward slot). Each pair's merged nodes
    spread, in merged order, over program positions the pair held: those of the pair's
    first pass (microbatches), or both slots' (a pipeline's). A backward all-to-all is
    unpaired where it is outside the microbatches (a pipeline's, the step's own), or
    where its pass reaches it after the other pass of its pair has ended in the merged
    order: the longer pass's tail (a backward pass takes about twice its forward pass)."""
    passes = microbatch_passes(graph)
    if passes:
        count = 1 + max(index for index, _ in passes)
        pairs, whole_span = pass_pairs(count), False
    else:
        passes = microbatch_passes(graph, tick_of)
        ticks = sorted({tick for tick, _ in passes})
        pairs = [((tick, Phase.BACKWARD), (tick + 1, Phase.FORWARD)) for tick in ticks]
        whole_span = True
    priorities: dict[int, float] = {}
    tails: set[int] = set()  # compute nodes run after the other pass of their pair ended
    for first, second in pairs:
        held, joining = passes.get(first, []), passes.get(second, [])
        if not held or not joining:
            continue
        merged = merge_chains(graph, held, joining, seconds)
        span = held + joining if whole_span else held
        low, high = min(span) - 0.5, max(span) + 0.5
        step = (high - low) / (len(merged) + 1)
        for rank, node in enumerate(merged, start=1):
            priorities[node] = low + rank * step
        # Each chain keeps its order in the merge: the one that ends first ends at its
        # last node, and the other's tail follows.
        shorter = joining if merged[-1] in held else held
        tails.update(merged[merged.index(shorter[-1]) + 1 :])
    if not priorities:
        return None
    _no_later_than_readers(graph, priorities, {n for nodes in passes.values() for n in nodes})
    unpaired = [
        start
        for start in graph.backward_all_to_alls()
        if microbatch_of(start) is None or any(p in tails for p in graph.preds[start.id])
    ]
    return Pairing(priorities, unpaired)


def _no_later_than_readers(graph: Graph, priorities: dict[int, float], in_passes: set[int]) -> None:
    """Gives each compute node outside the passes that a paired node waits for the key of
    its first such reader, in place. The later pass of a pair waits for work outside every
    pass: the gradients summed up to microbatch i - 3 and the barrier they pass with the
    weights (:data:`scheduling.names.MICROBATCHES_IN_FLIGHT`), which the program writes
    after microbatch i - 1. At its program position that work would run only once the
    passes before it had ended, and each pair would run as its two passes one after the
    other. An ancestor's id is below its reader's, so on equal keys it goes first."""
    keys: dict[int, float] = {}  # compute node outside the passes -> its key, if earlier
    for node in reversed(graph.nodes):
        if node.id in in_passes or node.role is not Role.COMPUTE:
            continue
        earliest = float(node.id)
        for succ in graph.succs[node.id]:
            earliest = min(earliest, priorities.get(succ, keys.get(succ, earliest)))
        if earliest < node.id:
            keys[node.id] = earliest
    priorities.update(keys)
