"""The list scheduler: the order of a graph's nodes, collectives started early and waited
for late, the dW placement kept.

The core of the scheduling layer: every candidate the search scores, and the step
emitted, runs in an order made here. Each node gets a priority key and
the ready node with the smallest key runs next, so the result is always a
topological order; the keys only choose among valid orders:

- a compute node keeps its program position, or the priority a pass gave it (paired
  microbatches, :mod:`scheduling.passes.pair_microbatches`);
- a collective start runs right after the last producer of its operand
  ("as soon as its inputs exist"), a gather of sharded weights no earlier than it
  takes to hide it (:mod:`scheduling.passes.prefetch`); where several become ready at
  once, the critical ones start first and the deferrable ones (gradient reductions, see
  ``scheduling.program.graph``) after the windows opened there, and those of one class
  in the order their results are first read, so that a runtime serving collectives in
  start order gives the critical path the link first;
- the dW nodes placed in a window run right after the window's start, in
  placement order;
- a collective done runs just before its first consumer ("only where it is
  needed"), or before the node a caller names (``waits``: where the simulated link
  has finished a gradient reduction, :mod:`scheduling.search.step_estimate`), and
  never before the nodes placed in its window.

Moving work changes how long buffers live. The live bytes of each order are
counted (a value lives from its producer to its last consumer; a collective's
result from its start); if the peak exceeds the original program's by more
than the allowed growth, placements are withdrawn, largest outputs first,
until it fits.
"""

from __future__ import annotations

import copy
import heapq
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from scheduling.passes.schedule_dw import Placement
from scheduling.program.capture import Value, aval_bytes
from scheduling.program.graph import Graph, Role

_STEP = 1e-3  # key offset between neighbours: far below the gap between program positions


@dataclass
class Order:
    """The order of a graph's nodes, with the dW placement it keeps and its live bytes."""

    nodes: list[int]  # node ids in execution order
    placement: Placement
    peak_live_bytes: int
    baseline_peak_live_bytes: int
    withdrawn: list[int]  # placements undone: cycles, then the live-bytes bound
    # Early starts alone can exceed the bound; nothing is withdrawn for them, but it is said.
    live_bytes_bound_exceeded: bool = False
    # How many of ``withdrawn`` (the last ones) the live-bytes bound undid.
    withdrawn_for_bound: int = 0


def _keys(
    graph: Graph,
    placement: Placement,
    priorities: dict[int, float] | None = None,
    earliest: dict[int, int] | None = None,
    waits: dict[int, float] | None = None,
) -> list[float]:
    keys = [float(node.id) for node in graph.nodes]
    earliest = earliest or {}
    for node, key in (priorities or {}).items():
        keys[node] = key
    starts = [node.id for node in graph.nodes if node.role is Role.START]
    # A start follows its operand's producer, which may be a placed node whose key follows
    # another window's start: iterate to the fixed point (a chain of windows is finite).
    for _ in range(len(starts) + 1):
        ready: dict[int, float] = {}
        for start in starts:
            offset = 2 * _STEP if start in graph.deferrable else _STEP
            key = max((keys[p] for p in graph.preds[start]), default=-1.0) + offset
            if start in earliest:  # a prefetch: no earlier than it takes to hide it
                key = max(key, keys[earliest[start]] - _STEP / 2)
            ready[start] = key
        _in_order_of_need(graph, keys, ready, earliest)
        changed = any(keys[start] != key for start, key in ready.items())
        for start, key in ready.items():
            keys[start] = key
        for start, nodes in placement.windows.items():
            for rank, node in enumerate(nodes, start=1):
                key = keys[start] + rank * _STEP / (len(nodes) + 1)
                changed |= key != keys[node]
                keys[node] = key
        if not changed:
            break
    for node in graph.nodes:
        if node.role is Role.DONE:
            consumers = graph.succs[node.id]
            first_use = min((keys[c] for c in consumers), default=float(len(graph.nodes)))
            first_use = min(first_use, (waits or {}).get(node.id, first_use))
            placed = placement.windows.get(node.partner, [])
            latest_placed = max((keys[p] for p in placed), default=keys[node.partner])
            keys[node.id] = max(first_use - _STEP, latest_placed + _STEP)
    return keys


def _in_order_of_need(
    graph: Graph, keys: list[float], ready: dict[int, float], prefetched: Collection[int]
) -> None:
    """Orders the starts of ``ready`` (start -> key) by when their results are first read,
    in place: the link serves collectives in the order they start, so that the compute
    stream gets first what it waits for first. Starts that share a key go in that order;
    so do the ``prefetched`` gathers of weights, each no earlier than those read before
    it (they read nothing the step computes, so waiting costs them nothing but the lead
    the link would have lost to the other anyway)."""
    latest = -1.0
    for start in sorted(prefetched, key=lambda start: (_first_read(graph, keys, start), start)):
        latest = ready[start] = max(ready[start], latest)
    together: dict[float, list[int]] = {}
    for start, key in ready.items():
        together.setdefault(key, []).append(start)
    for key, group in together.items():
        if len(group) < 2:
            continue
        group.sort(key=lambda start: (_first_read(graph, keys, start), start))
        for rank, start in enumerate(group):
            ready[start] = key + rank * _STEP / (4 * len(group))


def _first_read(graph: Graph, keys: list[float], start: int) -> float:
    """The key of the first node that reads what collective ``start`` makes."""
    done = graph.nodes[start].partner
    return min((keys[reader] for reader in graph.succs[done]), default=float(len(graph.nodes)))


class CyclicPlacement(Exception):
    """The window edges close a cycle; ``placed`` are the placed nodes held up by it.
    (``order`` withdraws such placements before it sorts.)"""

    def __init__(self, placed: list[int]):
        super().__init__(f"placements {placed} close a cycle")
        self.placed = placed


def topological_order(
    graph: Graph,
    placement: Placement,
    priorities: dict[int, float] | None = None,
    earliest: dict[int, int] | None = None,
    waits: dict[int, float] | None = None,
) -> list[int]:
    """Ready node with the smallest key first; window edges keep placed nodes inside.

    Raises :class:`CyclicPlacement` when the window edges make the graph cyclic (two
    windows each holding work that the other's collective needs).
    """
    # The window edges not already in the graph, on top of its own.
    added: dict[int, list[int]] = {}
    preds, succs = graph.preds, graph.succs
    waiting = [len(p) for p in preds]
    for start, nodes in placement.windows.items():
        done = graph.nodes[start].partner
        for source, target in [(start, n) for n in nodes] + [(n, done) for n in nodes]:
            if source not in preds[target] and target not in added.get(source, ()):
                added.setdefault(source, []).append(target)
                waiting[target] += 1
    keys = _keys(graph, placement, priorities, earliest, waits)
    ready = [(keys[n], n) for n in range(len(graph.nodes)) if waiting[n] == 0]
    heapq.heapify(ready)
    result = []
    # The inner loop of every order the scheduler makes: names bound locally.
    push, pop, emit, extra = heapq.heappush, heapq.heappop, result.append, added.get
    while ready:
        node = pop(ready)[1]
        emit(node)
        for succ in succs[node]:
            waiting[succ] -= 1
            if not waiting[succ]:
                push(ready, (keys[succ], succ))
        for succ in extra(node, ()):
            waiting[succ] -= 1
            if not waiting[succ]:
                push(ready, (keys[succ], succ))
    if len(result) != len(graph.nodes):
        stuck = set(range(len(graph.nodes))) - set(result)
        raise CyclicPlacement(
            sorted(n for nodes in placement.windows.values() for n in nodes if n in stuck)
        )
    return result


@dataclass(frozen=True)
class _Lifetimes:
    """Where each value of a graph (of some bytes) begins and ends, by node: the same for
    every order of it, so found once per graph. Arrays over the values, but ``readers``:
    the nodes that hold a read value (and not a result) until they run, those of each
    value from its offset in ``read_from``."""

    sizes: np.ndarray
    born: np.ndarray  # the node it is made at; -1: a program input (made at the start)
    read: np.ndarray  # the values read (their indices), results aside
    readers: np.ndarray
    read_from: np.ndarray
    results: np.ndarray  # the program's results (their indices): held to the end


_LIFETIMES: weakref.WeakKeyDictionary[Graph, _Lifetimes] = weakref.WeakKeyDictionary()


def _lifetimes(graph: Graph) -> _Lifetimes:
    found = _LIFETIMES.get(graph)
    if found is not None:
        return found
    born: dict[Value, int] = dict.fromkeys(graph.program.inputs, -1)
    uses: dict[Value, list[int]] = {}
    for node in graph.nodes:
        if node.role is not Role.DONE:  # a start or a compute node reads the operands
            # An async collective holds its operand until it is done.
            held_by = node.partner if node.role is Role.START else node.id
            for atom in node.op.inputs:
                if isinstance(atom, Value):
                    uses.setdefault(atom, []).append(held_by)
        if node.role is Role.START:
            continue  # the collective's result is recorded with its done
        # An async collective's result buffer exists from its start.
        born_at = node.partner if node.role is Role.DONE else node.id
        for value in node.op.outputs:
            born[value] = born_at
    results = {atom for atom in graph.program.outputs if isinstance(atom, Value)}
    sized = [(value, aval_bytes(value.aval)) for value in born]
    sized = [(value, size) for value, size in sized if size]
    read = [i for i, (v, _) in enumerate(sized) if v in uses and v not in results]
    held = [uses[sized[i][0]] for i in read]
    found = _Lifetimes(
        np.array([size for _, size in sized], np.int64),
        np.array([born[value] for value, _ in sized], np.int64),
        np.array(read, np.int64),
        np.array([node for nodes in held for node in nodes], np.int64),
        np.cumsum([0] + [len(nodes) for nodes in held[:-1]], dtype=np.int64),
        np.array([i for i, (v, _) in enumerate(sized) if v in results], np.int64),
    )
    _LIFETIMES[graph] = found
    return found


def peak_live_bytes(graph: Graph, order: list[int], until: int | None = None) -> int:
    """Largest total size of values alive at once when running in ``order`` (over its first
    ``until`` positions: None, all of them)."""
    lives = _lifetimes(graph)
    end = len(order)
    # Each node's position, and one more slot (0) that a program input's -1 reads.
    position = np.zeros(len(graph.nodes) + 1, np.int64)
    position[np.asarray(order, np.int64)] = np.arange(end)
    start = position[lives.born]
    last = start.copy()
    if lives.read.size:
        held = np.maximum.reduceat(position[lives.readers], lives.read_from)
        last[lives.read] = np.maximum(held, 0)
    last[lives.results] = end
    delta = np.zeros(end + 2, np.int64)
    np.add.at(delta, start, lives.sizes)
    np.add.at(delta, last + 1, -lives.sizes)
    live = np.cumsum(delta[:until])
    return max(0, int(live.max())) if live.size else 0


def order(
    graph: Graph,
    placement: Placement,
    max_live_bytes_growth: float = 0.1,
    priorities: dict[int, float] | None = None,
    earliest: dict[int, int] | None = None,
    waits: dict[int, float] | None = None,
    withdrawn_hint: int | None = None,
) -> Order:
    """A topological order honouring ``placement`` (a copy is kept) within the bound, the
    compute nodes of ``priorities`` at those keys instead of their program positions, and
    the starts of ``earliest`` no earlier than the node it gives each
    (:mod:`scheduling.passes.prefetch`), and the dones of ``waits`` no later than the key
    it gives each (a node id: before that node, where it keeps its program position).

    Placements that close a cycle are withdrawn first (each is kept unless, with those
    placed before it, it closes one), then, while the peak is over the bound, the largest
    outputs (the fewest that fit, by bisection; ``withdrawn_hint``: how many fitted an
    order like this one, tried first with the count before it, which brackets the same
    fewest where fewer withdrawn never fit better).
    (Priorities are not withdrawn: running two microbatches at once holds both's
    activations, which the order's peak reports. Where they alone exceed the bound,
    their peak is the bound: placements are withdrawn only while they add to it.)
    """
    placement = copy.deepcopy(placement)
    baseline = peak_live_bytes(graph, list(range(len(graph.nodes))))
    limit = baseline * (1 + max_live_bytes_growth)
    # What the priorities and early starts hold with nothing placed: withdrawing placements
    # cannot bring the peak below it, so it is the bound when it is over the limit.
    unplaced = topological_order(graph, Placement(), priorities, earliest, waits)
    floor = peak_live_bytes(graph, unplaced)
    if not any(placement.windows.values()):  # that order is this one
        return Order(unplaced, placement, floor, baseline, [], floor > limit)
    bound = max(limit, floor)
    try:  # where no window edge closes a cycle (most orders), nothing is withdrawn for one
        withdrawn: list[int] = []
        result = topological_order(graph, placement, priorities, earliest, waits)
    except CyclicPlacement:
        withdrawn = _withdraw_cycles(graph, placement)
        result = topological_order(graph, placement, priorities, earliest, waits)
    peak = peak_live_bytes(graph, result)
    for_bound = 0
    if peak > bound:
        # Withdrawn largest outputs first: the fewest of them that bring the peak within
        # the bound, found by bisection (withdrawing all of them reaches ``floor``).
        # Withdrawing never closes a cycle.
        placed = [n for nodes in placement.windows.values() for n in nodes]
        largest = sorted(placed, key=lambda n: (_output_bytes(graph, n), n), reverse=True)

        def without(count: int) -> tuple[Placement, list[int], int]:
            fewer = placement.without(largest[:count])
            ordered = topological_order(graph, fewer, priorities, earliest, waits)
            return fewer, ordered, peak_live_bytes(graph, ordered)

        # The latest order within the bound: of the fewest withdrawn so far, since the
        # bisection asks for fewer each time one fits. At first all withdrawn: the order
        # with nothing placed.
        latest = placement.without(largest), unplaced, floor

        def within(count: int) -> bool:
            nonlocal latest
            candidate = without(count)
            if candidate[2] > bound:
                return False
            latest = candidate
            return True

        high = fewest_within(within, len(largest), withdrawn_hint)
        placement, result, peak = latest
        withdrawn += largest[:high]
        for_bound = high
    return Order(result, placement, peak, baseline, withdrawn, peak > limit, for_bound)


def fewest_within(within: Callable[[int], bool], most: int, hint: int | None = None) -> int:
    """The fewest placements to withdraw, by bisection over ``1..most``: ``within(count)``
    says whether the order with ``count`` withdrawn is within the bound (not with none;
    with ``most``, all of them, it is: not asked). ``hint``: a count likely to be the
    answer, asked first with the count before it; for a ``within`` that holds from some
    count on, the answer is the same, in two questions where the hint is right."""
    low, high = 0, most  # over the bound with ``low`` withdrawn, within it with ``high``
    for count in () if hint is None else (hint, hint - 1):
        if low < count < high:
            if within(count):
                high = count
            else:
                low = count
    while high - low > 1:
        middle = (low + high) // 2
        if within(middle):
            high = middle
        else:
            low = middle
    return high


def _withdraw_cycles(graph: Graph, placement: Placement) -> list[int]:
    """Withdraw (from ``placement``, in place) the placements that close a cycle, and
    return them: in the order they were made, each is kept unless, with the graph's edges
    and the placements kept before it, its window edges (start -> node -> done) close one.

    A topological order of the edges kept so far is maintained as they are added
    (Pearce and Kelly's dynamic topological order): an edge that agrees with it costs
    nothing, and one that does not is decided by searching the nodes between its ends
    only, which are then reordered. The graph's node ids are a topological order."""
    succs = [list(s) for s in graph.succs]
    preds = [list(p) for p in graph.preds]
    position = list(range(len(graph.nodes)))  # node -> its place in the order

    def add_edge(source: int, target: int) -> bool:
        """Add ``source -> target`` unless it closes a cycle; whether it was added."""
        low, high = position[target], position[source]
        if low < high:
            # Forward from ``target`` and backward from ``source``, between the two places.
            forward, frontier, seen = [], [target], {target}
            while frontier:
                node = frontier.pop()
                forward.append(node)
                for succ in succs[node]:
                    if succ == source:
                        return False
                    if succ not in seen and position[succ] < high:
                        seen.add(succ)
                        frontier.append(succ)
            backward, frontier, seen = [], [source], {source}
            while frontier:
                node = frontier.pop()
                backward.append(node)
                for pred in preds[node]:
                    if pred not in seen and position[pred] > low:
                        seen.add(pred)
                        frontier.append(pred)
            # ``source``'s ancestors in that span move before ``target``'s descendants.
            moved = sorted(backward, key=position.__getitem__)
            moved += sorted(forward, key=position.__getitem__)
            for place, node in zip(sorted(position[n] for n in moved), moved, strict=True):
                position[node] = place
        succs[source].append(target)
        preds[target].append(source)
        return True

    def remove_edge(source: int, target: int) -> None:
        succs[source].remove(target)
        preds[target].remove(source)

    withdrawn = []
    for start, nodes in placement.windows.items():
        done = graph.nodes[start].partner
        for node in list(nodes):
            if not add_edge(start, node):
                withdrawn.append(node)
            elif not add_edge(node, done):
                remove_edge(start, node)
                withdrawn.append(node)
    for node in withdrawn:
        placement.remove(node)
    return withdrawn


def _output_bytes(graph: Graph, node: int) -> int:
    return sum(aval_bytes(v.aval) for v in graph.nodes[node].op.outputs)
