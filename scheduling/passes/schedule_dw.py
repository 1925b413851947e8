"""Pack weight-gradient (dW) work into the windows of the backward all-to-alls.

For each backward all-to-all, in launch order, the window's capacity is the
all-to-all's estimated time. Candidates are the dW nodes of that all-to-all
(no path to or from it, see ``graph``) that are not placed yet and whose
inputs will exist when the window opens: every predecessor is an ancestor of
the all-to-all's start, lies in an earlier window that closes before this
one opens, or was placed earlier in this window.

1. Forced: candidates whose last possible window is this one go in first.
2. Greedy best fit: repeatedly take the candidate whose estimated time is
   closest to the remaining time. Stop when the remaining time is <= 0, when
   no candidate is left, or when the best candidate is over twice the
   remaining time and something is already placed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduling.graph import Graph, Node


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


def schedule_dw(
    graph: Graph, seconds: Callable[[Node], float], windows: list[Node] | None = None
) -> Placement:
    """Place dW nodes into ``windows`` (default: the backward all-to-alls)."""
    windows = graph.backward_all_to_alls() if windows is None else windows
    candidates = {start.id: graph.dw_candidates(start) for start in windows}
    last_window: dict[int, int] = {}
    for start in windows:
        for node in graph.members(candidates[start.id]):
            last_window[node] = start.id

    placement = Placement()
    placed: dict[int, int] = {}  # node -> start id of its window
    for start in windows:
        before = graph.ancestors[start.id]
        closed = {s for s in placement.windows if graph.has_path(graph.nodes[s].partner, start.id)}
        window: list[int] = []
        placement.windows[start.id] = window
        pool = set(graph.members(candidates[start.id])) - placed.keys()

        def ready(node: int, before=before, closed=closed, window=window) -> bool:
            for pred in graph.preds[node]:
                if before >> pred & 1:
                    continue
                if placed.get(pred) in closed or pred in window:
                    continue
                return False
            return True

        def place(node: int, start_id=start.id, pool=pool, window=window) -> None:
            window.append(node)
            placed[node] = start_id
            pool.discard(node)

        remaining = seconds(start)
        # Forced nodes, in dependency order (ids are topological).
        progress = True
        while progress:
            progress = False
            for node in sorted(pool):
                if last_window[node] == start.id and ready(node):
                    place(node)
                    placement.forced.add(node)
                    remaining -= seconds(graph.nodes[node])
                    progress = True
        while remaining > 0:
            available = [node for node in pool if ready(node)]
            if not available:
                break
            best = min(
                available,
                key=lambda n: (abs(seconds(graph.nodes[n]) - remaining), n),
            )
            cost = seconds(graph.nodes[best])
            if cost > 2 * remaining and window:
                break
            place(best)
            remaining -= cost
    return placement
