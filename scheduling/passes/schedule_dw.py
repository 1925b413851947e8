"""Pack weight-gradient (dW) work into the windows of the backward all-to-alls.

For each backward all-to-all, in launch order, the window's capacity is the
all-to-all's estimated time. Candidates are the dW nodes of that all-to-all
(no path to or from it, see ``graph``) that are not placed yet and whose
inputs will exist when the window opens: every predecessor is an ancestor of
the all-to-all's start, lies in an earlier window that closes before this
one opens, or was placed earlier in this window.

1. Forced (unless ``force`` is off): candidates whose last possible window is this one
   go in first, with the not-yet-placed candidates they depend on.
   Forcing ignores the window's capacity: the last backward all-to-all can take far
   more work than it hides (the report shows placed time against window time). That
   hides the all-to-all behind work that would otherwise run after it, and holds back
   its result until the work is done; which weighs more depends on the step, so where
   the forced work overfills a window the search scores both
   (:func:`scheduling.search.step_estimate.schedule_program`).
2. Greedy best fit: repeatedly take the candidate whose estimated time is
   closest to the remaining time. Stop when the remaining time is <= 0, when
   no candidate is left, or when the best candidate is over twice the
   remaining time and something is already placed.

A candidate that reads nothing the step computes (a constant, an iota, a cast of a
parameter, and what is made of constants alone) hides no wait and could run in any
window; placed for its own sake it would only be made early and held. So it is never
placed alone, in either step: a placed node that reads it brings it along, into the
same window.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from scheduling.program.graph import Graph, Node


@dataclass
class Placement:
    """dW nodes placed in each window, keyed by the window's start node id."""

    windows: dict[int, list[int]] = field(default_factory=dict)
    forced: set[int] = field(default_factory=set)

    def window_of(self) -> dict[int, int]:
        return {node: start for start, nodes in self.windows.items() for node in nodes}

    def remove(self, node: int) -> None:
        for nodes in self.windows.values():
            if node in nodes:
                nodes.remove(node)
        self.forced.discard(node)

    def without(self, nodes: Collection[int]) -> Placement:
        """A copy with ``nodes`` withdrawn (one pass over the placements)."""
        gone = set(nodes)
        return Placement(
            {start: [n for n in placed if n not in gone] for start, placed in self.windows.items()},
            self.forced - gone,
        )


def schedule_dw(
    graph: Graph,
    seconds: Callable[[Node], float],
    windows: list[Node] | None = None,
    force: bool = True,
) -> Placement:
    """Place dW nodes into ``windows`` (default: the backward all-to-alls); ``force``: each
    window takes first the candidates whose last window it is, whatever its capacity."""
    windows = graph.backward_all_to_alls() if windows is None else windows
    candidates = {start.id: graph.dw_candidates(start) for start in windows}
    last_window: dict[int, int] = {}
    for start in windows:
        for node in graph.members(candidates[start.id]):
            last_window[node] = start.id

    inert = _inert(graph)

    placement = Placement()
    placed: dict[int, int] = {}  # node -> start id of its window
    for start in windows:
        window = _Window(graph, start, placement, placed, inert)
        pool = set(graph.members(candidates[start.id])) - placed.keys()
        remaining = seconds(start)

        # 1. Forced: this is the node's last window; bring the candidates it needs along.
        for node in sorted(pool) if force else ():
            if node not in pool or last_window[node] != start.id or inert[node]:
                continue
            needed = window.missing_inputs(node, pool)
            if needed is None:
                continue  # an input can be neither available nor placed in this window
            for member in [*needed, node]:
                window.place(member, pool)
                placement.forced.add(member)
                remaining -= seconds(graph.nodes[member])

        # 2. Greedy best fit by estimated time. Placing a node makes values available and
        # never takes one away: the ready candidates are kept up to date, not recounted.
        cost = {node: seconds(graph.nodes[node]) for node in pool}
        ready = {node for node in pool if not inert[node] and window.ready(node, pool)}
        while remaining > 0 and ready:
            best = min(ready, key=lambda n: (abs(cost[n] - remaining), n))
            if cost[best] > 2 * remaining and window.nodes:
                break
            for member in [*window.inert_inputs(best, pool), best]:
                window.place(member, pool)
                ready.discard(member)
                remaining -= cost[member]
            ready.update(n for n in graph.succs[best] if n in pool and window.ready(n, pool))
    return placement


def _inert(graph: Graph) -> list[bool]:
    """Whether each node reads nothing the step computes: it reads the step's inputs and
    literals alone, or it is a constant (made of literals, and of constants, alone)."""
    inputs = set(graph.program.inputs)
    constant: list[bool] = []
    for node in graph.nodes:  # node ids are a topological order
        reads_input = any(atom in inputs for atom in node.op.inputs)
        constant.append(not reads_input and all(constant[p] for p in graph.preds[node.id]))
    return [constant[node.id] or not graph.preds[node.id] for node in graph.nodes]


class _Window:
    """One window being filled: which values exist in it, and placing nodes into it."""

    def __init__(
        self,
        graph: Graph,
        start: Node,
        placement: Placement,
        placed: dict[int, int],
        inert: list[bool],
    ):
        self.graph = graph
        self.inert = inert
        self.start = start.id
        self.placed = placed
        self.before = graph.ancestors[start.id]
        # Earlier windows that close before this one opens.
        self.closed = {
            s for s in placement.windows if graph.has_path(graph.nodes[s].partner, start.id)
        }
        self.nodes: list[int] = []
        placement.windows[start.id] = self.nodes

    def available(self, node: int) -> bool:
        """Whether ``node``'s result exists inside this window."""
        return (
            bool(self.before >> node & 1)
            or self.placed.get(node) in self.closed
            or self.placed.get(node) == self.start
        )

    def ready(self, node: int, pool: set[int]) -> bool:
        """Whether ``node`` can run here, bringing along the inert inputs it needs."""
        preds = self.graph.preds[node]
        if not all(self.available(pred) or self.inert[pred] for pred in preds):
            return False
        return self.inert_inputs(node, pool) is not None

    def inert_inputs(self, node: int, pool: set[int]) -> list[int] | None:
        """The inert candidates to place before ``node`` (in id order): those it reads
        that are not available here, and theirs; None when one is not a candidate."""
        return self._needed(node, pool, lambda pred: self.inert[pred])

    def missing_inputs(self, node: int, pool: set[int]) -> list[int] | None:
        """Candidates to place before ``node`` so that it can run here (in id order), or
        None when one of its inputs can be neither available nor placed here."""
        return self._needed(node, pool, lambda pred: True)

    def _needed(
        self, node: int, pool: set[int], follows: Callable[[int], bool]
    ) -> list[int] | None:
        needed: set[int] = set()
        frontier = [node]
        while frontier:
            for pred in self.graph.preds[frontier.pop()]:
                if pred in needed or self.available(pred) or not follows(pred):
                    continue
                if pred not in pool:
                    return None
                needed.add(pred)
                frontier.append(pred)
        return sorted(needed)

    def place(self, node: int, pool: set[int]) -> None:
        self.nodes.append(node)
        self.placed[node] = self.start
        pool.discard(node)
