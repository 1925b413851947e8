"""Two-stream timeline of a scheduled program: one compute stream, one communication stream.

Nodes run on the compute stream in schedule order. A collective's start hands
it to the communication stream (the link), which runs collectives one at a
time; its done stalls the compute stream until the collective has finished.
A collective that was not split runs synchronously: the compute stream waits
for it to get the link and then for the whole transfer. A collective priced at nothing
moves nothing (one over axes of a single device, the identity, which XLA removes): it
finishes where it is issued, without waiting for the link. With
``asynchronous=False`` every collective runs so, a split one at its start: a
backend that runs collectives where they stand in the program and lets nothing
run beside them, as XLA's CPU backend does with its own collectives (it compiles
start/done pairs back to synchronous ones; the overlap control of
``experiments.overlap_control`` shows no overlap with them). ``asynchronous`` may
also be a predicate of the start node: the split collectives it accepts overlap,
the others run at their start (on the CPU backend: a transport of one's own, such as the
emulated cluster's socket all-to-alls, against XLA's own collectives).

Which collective the link runs next. With ``priorities`` (the default), the
collectives waiting for the link form two classes: critical ones first, then
the deferrable ones (gradient and metric reductions, see ``scheduling.program.graph``),
each class in start order; a transfer, once begun, runs to its end. This is a
runtime that keeps its pending collectives in two queues, as one with a
high-priority stream for the critical path does. Without priorities the link
serves collectives in start order, one queue for all.

Host work of collectives. ``host`` (seconds per collective node) is what issuing and
completing a collective costs the compute stream beside its transfer: a start's before
it hands the collective to the link, a done's after the transfer has finished, an unsplit
collective's before it. A runtime whose collectives are host callbacks (the emulated
cluster's socket all-to-all) spends it copying pieces in and out;
:mod:`scheduling.reports.traced_costs` measures it. It counts in the step, not in its compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from scheduling.program.graph import Graph, Node, Role


@dataclass
class CollectiveTiming:
    node: int  # the start node (or the single node of a synchronous collective)
    issued: float  # when the compute stream reached its start
    began: float  # when the link began the transfer
    finished: float
    stall: float  # compute-stream time lost waiting for it
    deferrable: bool = False  # its priority class on the link (see the module docstring)
    reached: float = 0.0  # when the compute stream reached its done (its start, if sync)


class Event(NamedTuple):
    """One interval on a stream: a node running, or the compute stream waiting (a tuple:
    a search makes one for every node of every order it simulates)."""

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

    def link_holders(self, begin: float, end: float) -> tuple[float, float]:
        """Seconds of ``[begin, end)`` during which the link ran critical collectives, and
        deferrable ones."""
        critical = deferrable = 0.0
        for event in self.events:
            if event.stream != "communication":
                continue
            held = min(end, event.start + event.seconds) - max(begin, event.start)
            if held <= 0:
                continue
            if self.collectives[event.node].deferrable:
                deferrable += held
            else:
                critical += held
        return critical, deferrable


class _Link:
    """The communication stream: transfers waiting for it, and those it ran."""

    def __init__(self, priorities: bool, events: list[Event]):
        self.priorities = priorities
        self.events = events
        self.free = 0.0
        self.busy = 0.0
        self.waiting: list[tuple[int, CollectiveTiming, float]] = []  # (issue rank, ...)
        self.issued = 0

    def issue(self, timing: CollectiveTiming, seconds: float) -> None:
        self.waiting.append((self.issued, timing, seconds))
        self.issued += 1

    def _next(self) -> tuple[float, int]:
        """When the next transfer begins, and its index in ``waiting``."""
        at = max(self.free, min(timing.issued for _, timing, _ in self.waiting))
        ready = [i for i, (_, timing, _) in enumerate(self.waiting) if timing.issued <= at]

        def rank(i: int) -> tuple[bool, int]:
            issued_rank, timing, _ = self.waiting[i]
            return (self.priorities and timing.deferrable, issued_rank)

        return at, min(ready, key=rank)

    def run(self, before: float | None = None, until: CollectiveTiming | None = None) -> None:
        """Begin the transfers that begin before ``before`` (no limit when None), or
        stop once ``until`` has begun. Whatever begins later may still lose its turn to
        a collective started in the meantime."""
        while self.waiting and (until is None or self._is_waiting(until)):
            at, index = self._next()
            if before is not None and at >= before:
                return
            _, timing, seconds = self.waiting.pop(index)
            timing.began, timing.finished = at, at + seconds
            self.free = timing.finished
            self.busy += seconds
            self.events.append(Event(timing.node, "communication", at, seconds))

    def _is_waiting(self, timing: CollectiveTiming) -> bool:
        return any(waiting is timing for _, waiting, _ in self.waiting)


def simulate(
    graph: Graph,
    order: list[int],
    seconds: Callable[[Node], float],
    *,
    asynchronous: bool | Callable[[Node], bool] = True,
    priorities: bool = True,
    host: Callable[[Node], float] | None = None,
) -> Timeline:
    overlaps = asynchronous if callable(asynchronous) else lambda node: asynchronous
    host_seconds = host or (lambda node: 0.0)
    compute_clock = compute_total = 0.0
    timings: dict[int, CollectiveTiming] = {}
    in_flight: dict[int, CollectiveTiming] = {}  # by start node: issued, not yet waited for
    events: list[Event] = []
    link = _Link(priorities, events)

    def issue(node_id: int) -> CollectiveTiming:
        link.run(before=compute_clock)  # who goes first is decided with all issued so far
        timing = CollectiveTiming(
            node_id, compute_clock, 0.0, 0.0, 0.0, node_id in graph.deferrable
        )
        timings[node_id] = timing
        transfer = seconds(graph.nodes[node_id])
        if transfer > 0:
            link.issue(timing, transfer)
        else:  # it moves nothing: no turn on the link to wait for
            timing.began = timing.finished = compute_clock
        return timing

    def wait(timing: CollectiveTiming) -> None:
        nonlocal compute_clock
        link.run(until=timing)  # nothing is started while the compute stream waits
        timing.reached = compute_clock
        timing.stall = max(0.0, timing.finished - compute_clock)
        if timing.stall > 0:
            events.append(Event(timing.node, "compute", compute_clock, timing.stall, True))
        compute_clock += timing.stall

    def host_work(node: Node) -> None:
        nonlocal compute_clock
        seconds = host_seconds(node)
        if seconds > 0:
            events.append(Event(node.id, "compute", compute_clock, seconds))
            compute_clock += seconds

    # The loop runs for every node of every order a search weighs: names bound locally.
    nodes, start, done, record = graph.nodes, Role.START, Role.DONE, events.append
    for node_id in order:
        node = nodes[node_id]
        if node.role is start and overlaps(node):
            host_work(node)
            in_flight[node_id] = issue(node_id)
        elif node.role is done:
            if node.partner in in_flight:
                wait(in_flight.pop(node.partner))
            host_work(node)  # a collective run at its start finished there
        elif node.is_collective:  # synchronous: the compute stream waits for all of it
            host_work(node)
            wait(issue(node_id))
        else:
            duration = seconds(node)
            record(Event(node_id, "compute", compute_clock, duration))
            compute_clock += duration
            compute_total += duration
    link.run()
    return Timeline(compute_clock, compute_total, link.busy, timings, events)
