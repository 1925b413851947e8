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

Two passes run side by side, and as one ends the next joins (:func:`pass_order`: forward
0 and forward 1, then backward i and forward i+2 in turn, the last two backward passes
last), so that no pass runs alone but the last: a backward pass takes about twice its
forward pass, and once forward i+2 has ended, backward i+1 runs beside the rest of
backward i (pairing passes two by two left each backward pass's second half alone). The
cost is one more microbatch's activations in flight, as for pairs. A pipeline's slots
join in :func:`slot_order`: a backward slot waits for the one before it (through the
stages' exchange), so its tail still runs alone. All passes' compute nodes are merged in
one order, that of a two-stream simulation (:func:`merge_chains`): where both chains
beside each other can go next, each is tried first in a short run ahead of the two, and
the one whose run ends sooner goes; the runs take the chain that can start first, and
when both can, the one nearer its next collective, so that the collective is on the link
while the other chain computes; the link carries each chain's collectives as soon as
their operands exist. (Without that rule, ties going to one chain, the Lancet paper's
GPT-2 MoE on 16 V100s hid 59% of the exposed all-to-all instead of all of it; the rule
alone, without the runs ahead, keeps the two chains in step, both waiting for the link
together.) The result is a priority for every compute node (:func:`pair_passes`), spread
in merged order over the program positions the passes held, which the order pass uses in
place of program positions; collectives then start as early and finish as late as ever,
and the merged neighbours fill the windows between. (Keys per pair, over each pair's own
positions, overlapped the next pair's where a tick's backward slot lies inside its
forward slot's positions, and the order ran three slots at once against a merge of two.)
Work outside every pass that a paired node waits for (from
:data:`~scheduling.names.MICROBATCHES_IN_FLIGHT` times two microbatches on, the
gradients summed up to microbatch i - 3 and the barrier that lets microbatch i start)
gets the key of its first such reader: at its program position it would hold the later
passes until the earlier ones had ended. The backward all-to-alls that run alone (the
last backward pass's tail, a pipeline's, those outside the microbatches) are windows no
other pass fills, and the dW work of :mod:`scheduling.passes.schedule_dw` goes into
them."""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class Merged:
    """Chains' compute nodes in the order one compute stream would run them, and those it
    runs while no other chain beside them can start."""

    order: list[int]
    alone: set[int]
    end: float  # when the last of them ends


LOOKAHEAD = 6  # the collectives ahead on each chain that a choice of the merge is judged by


def merge_chains(
    graph: Graph,
    chains: Sequence[list[int]],
    seconds: Callable[[Node], float],
    lookahead: int = LOOKAHEAD,
) -> Merged:
    """The compute nodes of independent chains, in the order one compute stream and one
    link would run them, two chains side by side: the first two, then each next one as
    soon as one of those ends. Each chain keeps its program order. A chain waits for what
    its nodes read: the merged nodes of the others, and the work outside every chain
    between (a pipeline's exchange of one tick's results with the next stage), which is
    taken to run as soon as what it reads is there.

    Which chain goes next. Where only one can start, that one. Where both can (one
    perhaps later, once a collective it waits for is done), each is tried first in a run
    of the two ahead (:func:`_run_ahead`: until each has put its next ``lookahead``
    collectives on the link, or ended), and the one whose run ends sooner goes: waiting
    for the other can keep compute in hand for a later window. The runs ahead take, after
    the first node, the one that can start first, and when both can, the one that reaches
    its next collective sooner, so that the collective is on the link while the other
    chain computes (ties: the earlier chain); ``lookahead`` 0 takes that rule alone. (The
    rule alone puts the two chains in step: both reach their all-to-alls together and wait
    for the link together. The runs ahead take 5% off the estimated step of Mixtral 8x22B
    at its recipe in four stages, experiments/results/scale_eval.md.)"""
    in_chains = {node for chain in chains for node in chain}
    finish: dict[int, float] = {}  # merged node, or work outside the chains -> its result
    link_free = 0.0
    now = 0.0

    def issue(start: int, at: float) -> None:
        """Puts collective ``start``, reached at ``at``, on the link after those before it;
        its result is there when the link has carried it."""
        nonlocal link_free
        link_free = max(link_free, at) + seconds(graph.nodes[start])
        finish[start] = link_free

    def available(node: int) -> float:
        """When ``node``'s result is there (infinite while it waits for a chain's node
        not merged yet)."""
        pending = [node]
        while pending:
            current = pending[-1]
            if current in finish:
                pending.pop()
                continue
            if current in in_chains:
                return math.inf
            graph_node = graph.nodes[current]
            reads = [graph_node.partner] if graph_node.role is Role.DONE else graph.preds[current]
            unknown = [p for p in reads if p not in finish]
            if unknown:
                if any(p in in_chains for p in unknown):
                    return math.inf
                pending.extend(unknown)
                continue
            at = max((finish[p] for p in reads), default=0.0)
            pending.pop()
            if graph_node.role is Role.START:
                issue(current, at)
            elif graph_node.role is Role.DONE:
                finish[current] = at
            else:
                finish[current] = at + seconds(graph_node)
        return finish[node]

    def ready_at(node: int) -> float:
        return max((available(p) for p in graph.preds[node]), default=0.0)

    def issue_collectives(after: int) -> None:
        for succ in graph.succs[after]:
            if graph.nodes[succ].role is Role.START and succ not in finish:
                at = ready_at(succ)
                if at < math.inf:
                    issue(succ, at)

    ahead = [_Ahead.of(graph, chain, seconds) for chain in chains if chain]
    heads = [0] * len(ahead)
    beside = [0, 1][: len(ahead)]  # the chains side by side, earlier first
    joined = len(beside)
    merged: list[int] = []
    alone: set[int] = set()
    while beside:
        candidates = sorted(
            (max(now, ready_at(ahead[c].nodes[heads[c]])), ahead[c].to_collective[heads[c]], c)
            for c in beside
        )
        start_at, _, index = candidates[0]
        if start_at == math.inf:  # both wait for a chain not beside them yet
            start_at, index = now, beside[0]
        elif lookahead and len(candidates) > 1 and candidates[1][0] < math.inf:
            runs = [
                (_run_ahead(ahead, beside, heads, c, now, link_free, finish, lookahead), rank)
                for rank, (_, _, c) in enumerate(candidates)
            ]
            start_at, _, index = candidates[min(runs)[1]]
        node = ahead[index].nodes[heads[index]]
        heads[index] += 1
        now = start_at + seconds(graph.nodes[node])
        finish[node] = now
        merged.append(node)
        if all(at == math.inf for at, _, c in candidates if c != index):
            alone.add(node)
        issue_collectives(node)
        if heads[index] == len(ahead[index].nodes):
            beside.remove(index)
            if joined < len(ahead):
                beside.append(joined)
                joined += 1
    return Merged(merged, alone, now)


@dataclass(frozen=True)
class _Ahead:
    """One chain as a run ahead reads it, node by node: what each costs, waits for and
    puts on the link."""

    nodes: list[int]
    seconds: list[float]
    to_collective: list[float]  # compute seconds up to the next node that issues one
    waits: list[tuple[int, ...]]  # the collectives (starts) whose results it reads
    issues: list[tuple[tuple[int, float], ...]]  # (start, link seconds) it is last to feed
    issuing: list[int]  # the indices of the nodes that issue a collective
    elapsed: list[float]  # the compute seconds of the nodes before each (one more: all)
    plain_to: list[int]  # the first node from each on that waits for or issues one

    @classmethod
    def of(cls, graph: Graph, chain: list[int], seconds: Callable[[Node], float]) -> _Ahead:
        place = {node: index for index, node in enumerate(chain)}
        issues: list[list[tuple[int, float]]] = [[] for _ in chain]
        for index, node in enumerate(chain):
            for succ in graph.succs[node]:
                if graph.nodes[succ].role is Role.START:
                    last = max(place.get(p, -1) for p in graph.preds[succ])
                    if last == index:
                        issues[index].append((succ, seconds(graph.nodes[succ])))
        waits = [
            tuple(p for p in graph.preds[node] if graph.nodes[p].role is Role.DONE)
            for node in chain
        ]
        return cls.derived(
            chain,
            [seconds(graph.nodes[node]) for node in chain],
            _to_next_collective(graph, chain, seconds),
            [tuple(graph.nodes[p].partner for p in found) for found in waits],
            [tuple(found) for found in issues],
        )

    @classmethod
    def derived(
        cls,
        nodes: list[int],
        seconds: list[float],
        to_collective: list[float],
        waits: list[tuple[int, ...]],
        issues: list[tuple[tuple[int, float], ...]],
    ) -> _Ahead:
        """The chain of these ``nodes``, each costing, waiting for and issuing these, with
        the indices a run ahead jumps by derived from them."""
        plain_to = [len(nodes)] * (len(nodes) + 1)
        for index in reversed(range(len(nodes))):
            plain_to[index] = index if waits[index] or issues[index] else plain_to[index + 1]
        return cls(
            nodes=nodes,
            seconds=seconds,
            to_collective=to_collective,
            waits=waits,
            issues=issues,
            issuing=[index for index, found in enumerate(issues) if found],
            elapsed=list(itertools.accumulate(seconds, initial=0.0)),
            plain_to=plain_to,
        )

    def horizon(self, head: int, lookahead: int) -> int:
        """The index past the node that issues the ``lookahead``-th collective from
        ``head`` on (the chain's end where fewer are left)."""
        at = bisect.bisect_left(self.issuing, head) + lookahead - 1
        return self.issuing[at] + 1 if at < len(self.issuing) else len(self.nodes)


def _run_ahead(
    ahead: Sequence[_Ahead],
    beside: Sequence[int],
    heads: Sequence[int],
    first: int,
    now: float,
    link_free: float,
    finish: dict[int, float],
    lookahead: int,
) -> float:
    """When the chains ``beside``, from ``heads`` at ``now`` with the link free from
    ``link_free``, have each put their next ``lookahead`` collectives on the link (or
    ended), starting with chain ``first``'s next node and then as the merge's rule alone
    would. Only the collectives a chain issues itself hold it (the results of those issued
    before come from ``finish``); what the chains read of each other and of the work
    outside them is taken to be there."""
    heads = {c: heads[c] for c in beside}
    ends = {c: ahead[c].horizon(heads[c], lookahead) for c in beside}
    issued: dict[int, float] = {}
    pick: int | None = first
    while True:
        options = []
        for c in beside:
            head = heads[c]
            if head >= ends[c]:
                continue
            chain = ahead[c]
            ready = now
            for start in chain.waits[head]:
                done = issued.get(start)
                if done is None:
                    done = finish.get(start, 0.0)
                if done > ready:
                    ready = done
            options.append((ready, chain.to_collective[head], c))
        if not options:
            return now
        best = min(options) if pick is None else next(o for o in options if o[2] == pick)
        pick = None
        ready, _, c = best
        chain = ahead[c]
        head = heads[c]
        now = ready + chain.seconds[head]
        for start, link in chain.issues[head]:
            link_free = (link_free if link_free > now else now) + link
            issued[start] = link_free
        head += 1
        # The nodes after it that neither wait nor issue: it keeps the stream until the
        # other chain can start and is nearer its collective, or they end.
        stop = min(chain.plain_to[head], ends[c])
        if head < stop:
            other = [o for o in options if o[2] != c]
            base = chain.elapsed[head] - now  # a node's start is elapsed[node] - base
            if other:
                ((ready_other, near, o),) = other
                # The first of them to start once the other can.
                at = bisect.bisect_left(chain.elapsed, ready_other + base, head, stop)
                if at < stop and (chain.to_collective[at], c) > (near, o):
                    stop = at
            now = chain.elapsed[stop] - base
            head = stop
        heads[c] = head


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


def pass_order(count: int) -> list[Pass]:
    """The passes of ``count`` microbatches in the order they join the two running side
    by side: forward 0 and forward 1, then backward i and forward i + 2 in turn, the last
    two backward passes last."""
    if count < 2:
        return []
    forward, backward = Phase.FORWARD, Phase.BACKWARD
    middle = [p for i in range(count - 2) for p in ((i, backward), (i + 2, forward))]
    return [(0, forward), (1, forward), *middle, (count - 2, backward), (count - 1, backward)]


def slot_order(ticks: Sequence[int]) -> list[Pass]:
    """A pipeline's slots, as ``(tick, phase)``, in the order they join the two running
    side by side: the first forward slot, then each tick's backward slot and the next
    tick's forward slot in turn. A forward slot waits for the one before it and a
    backward slot for its own forward slot and the backward slot before it (through the
    stages' exchanges), so tick k's backward slot runs beside tick k + 1's forward slot,
    and its tail before tick k + 1's backward slot."""
    if not ticks:
        return []
    forward, backward = Phase.FORWARD, Phase.BACKWARD
    return [(ticks[0], forward), *(p for t in ticks for p in ((t, backward), (t + 1, forward)))]


@dataclass(frozen=True)
class Pairing:
    """How a step's passes run side by side: a key for each compute node of a pass
    (and for the work outside the passes that one waits for), which the order uses in
    place of program positions; and the backward all-to-alls whose windows no other
    pass fills, for the dW work of :mod:`scheduling.passes.schedule_dw`."""

    priorities: dict[int, float]
    unpaired: list[Node]


def pair_passes(graph: Graph, seconds: Callable[[Node], float]) -> Pairing | None:
    """The pairing of ``graph``'s passes (None where nothing pairs: fewer than two
    microbatches, a pipeline of one slot): all of them merged at once
    (:func:`merge_chains`), microbatches in :func:`pass_order`, a pipeline's slots in
    :func:`slot_order`, and the merged nodes spread, in merged order, over the program
    positions the passes held. A backward all-to-all is unpaired where it is outside the
    microbatches (a pipeline's, the step's own), or where its pass reaches it alone (the
    last backward pass's tail)."""
    passes = microbatch_passes(graph)
    if passes:
        order = pass_order(1 + max(index for index, _ in passes))
    else:
        passes = microbatch_passes(graph, tick_of)
        order = slot_order(sorted({tick for tick, _ in passes}))
    chains = [passes[p] for p in order if p in passes]
    if len(chains) < 2:
        return None
    merged = merge_chains(graph, chains, seconds)
    span = [node for chain in chains for node in chain]
    low, high = min(span) - 0.5, max(span) + 0.5
    step = (high - low) / (len(merged.order) + 1)
    priorities = {node: low + rank * step for rank, node in enumerate(merged.order, start=1)}
    _no_later_than_readers(graph, priorities, set(span))
    unpaired = [
        start
        for start in graph.backward_all_to_alls()
        if microbatch_of(start) is None or any(p in merged.alone for p in graph.preds[start.id])
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
