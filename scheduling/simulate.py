"""Two-stream timeline of a scheduled program: one compute stream, one communication stream.

Nodes run on the compute stream in schedule order. A collective's start hands
it to the communication stream, which runs collectives one at a time in start
order; its done stalls the compute stream until the collective has finished.
A collective that was not split runs synchronously: the compute stream waits
for the link to be free and then for the whole transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduling.graph import Graph, Node, Role


@dataclass
class CollectiveTiming:
    node: int  # the start node (or the single node of a synchronous collective)
    issued: float  # when the compute stream reached its start
    began: float  # when the link began the transfer
    finished: float
    stall: float  # compute-stream time lost waiting for it


@dataclass
class Timeline:
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    collectives: dict[int, CollectiveTiming] = field(default_factory=dict)

    @property
    def exposed_communication_seconds(self) -> float:
        return sum(timing.stall for timing in self.collectives.values())


def simulate(graph: Graph, order: list[int], seconds: Callable[[Node], float]) -> Timeline:
    compute_clock = link_free = 0.0
    compute_total = communication_total = 0.0
    timings: dict[int, CollectiveTiming] = {}
    for node_id in order:
        node = graph.nodes[node_id]
        if node.role is Role.START:
            duration = seconds(node)
            began = max(compute_clock, link_free)
            link_free = began + duration
            communication_total += duration
            timings[node_id] = CollectiveTiming(node_id, compute_clock, began, link_free, 0.0)
        elif node.role is Role.DONE:
            timing = timings[node.partner]
            timing.stall = max(0.0, timing.finished - compute_clock)
            compute_clock += timing.stall
        elif node.is_collective:  # synchronous collective
            duration = seconds(node)
            began = max(compute_clock, link_free)
            link_free = began + duration
            communication_total += duration
            timings[node_id] = CollectiveTiming(
                node_id, compute_clock, began, link_free, link_free - compute_clock
            )
            compute_clock = link_free
        else:
            duration = seconds(node)
            compute_clock += duration
            compute_total += duration
    return Timeline(compute_clock, compute_total, communication_total, timings)
