"""Two-stream timeline of a scheduled program: one compute stream, one communication stream.

Nodes run on the compute stream in schedule order. A collective's start hands
it to the communication stream, which runs collectives one at a time in start
order; its done stalls the compute stream until the collective has finished.
A collective that was not split runs synchronously: the compute stream waits
for the link to be free and then for the whole transfer. With
``asynchronous=False`` every collective runs so, a split one at its start: a
backend that runs collectives where they stand in the program and lets nothing
run beside them. (XLA's CPU backend compiles start/done pairs back to
synchronous collectives, but its runtime still runs independent ops while one
waits on the network, so it is closer to the asynchronous replay.)
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


@dataclass(frozen=True)
class Event:
    """One interval on a stream: a node running, or the compute stream waiting."""

    node: int
    stream: str  # "compute" or "communication"
    start: float
    seconds: float
    waiting: bool = False  # the compute stream stalled on this collective


@dataclass
class Timeline:
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    collectives: dict[int, CollectiveTiming] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    @property
    def exposed_communication_seconds(self) -> float:
        return sum(timing.stall for timing in self.collectives.values())


def simulate(
    graph: Graph,
    order: list[int],
    seconds: Callable[[Node], float],
    *,
    asynchronous: bool = True,
) -> Timeline:
    compute_clock = link_free = 0.0
    compute_total = communication_total = 0.0
    timings: dict[int, CollectiveTiming] = {}
    events: list[Event] = []

    def transfer(node_id: int, duration: float) -> float:
        nonlocal link_free, communication_total
        began = max(compute_clock, link_free)
        link_free = began + duration
        communication_total += duration
        events.append(Event(node_id, "communication", began, duration))
        return began

    for node_id in order:
        node = graph.nodes[node_id]
        if node.role is Role.START and asynchronous:
            began = transfer(node_id, seconds(node))
            timings[node_id] = CollectiveTiming(node_id, compute_clock, began, link_free, 0.0)
        elif node.role is Role.DONE:
            if not asynchronous:
                continue
            timing = timings[node.partner]
            timing.stall = max(0.0, timing.finished - compute_clock)
            if timing.stall > 0:
                events.append(Event(node.partner, "compute", compute_clock, timing.stall, True))
            compute_clock += timing.stall
        elif node.is_collective:  # synchronous: the compute stream waits for all of it
            began = transfer(node_id, seconds(node))
            stall = link_free - compute_clock
            timings[node_id] = CollectiveTiming(node_id, compute_clock, began, link_free, stall)
            events.append(Event(node_id, "compute", compute_clock, stall, True))
            compute_clock = link_free
        else:
            duration = seconds(node)
            events.append(Event(node_id, "compute", compute_clock, duration))
            compute_clock += duration
            compute_total += duration
    return Timeline(compute_clock, compute_total, communication_total, timings, events)
