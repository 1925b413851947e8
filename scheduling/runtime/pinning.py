"""How the scheduled windows are held in place against XLA:GPU's own scheduler.

One choice per step (``SchedulePolicy.xla_pin``): between optimization barriers
(:mod:`scheduling.runtime.xla_barriers`, the default), or not at all; or, an
experimental option (``ExperimentalOptions.xla_groups``), as XLA scheduling groups
(:mod:`scheduling.runtime.xla_groups`). Whatever the choice, a step for
GPU marks each window's nodes with the window's number, so that its compiled order can be
read against the schedule (:mod:`scheduling.runtime.hlo_windows`); with barriers it also
carries each window's latency for XLA's latency estimator
(:mod:`scheduling.runtime.xla_latencies`) and the most collectives the schedule has in
flight at once, XLA's limit for the step's compiles. The emitter
(:mod:`scheduling.runtime.emit`) traces what a :class:`Pinning` says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduling.order.list_scheduler import Order
from scheduling.program import jax_adapter
from scheduling.program.capture import Op
from scheduling.program.graph import Graph, Role
from scheduling.runtime.xla_barriers import WINDOW_ATTRIBUTE, Pin, window_pins
from scheduling.runtime.xla_groups import GROUP_ATTRIBUTE, scheduling_groups
from scheduling.runtime.xla_latencies import window_latencies

# The XLA:GPU option bounding how many async collectives its scheduler keeps in flight.
OVERLAP_LIMIT_OPTION = "xla_gpu_experimental_parallel_collective_overlap_limit"


@dataclass(frozen=True)
class Pinning:
    """How the scheduled windows are held in place on XLA:GPU: each node of ``marks``
    traced with ``attribute`` (its window or group), and the barriers of ``pins``."""

    attribute: str = WINDOW_ATTRIBUTE
    marks: Mapping[int, int] = field(default_factory=dict)  # node -> window or group
    pins: Mapping[int, Pin] = field(default_factory=dict)  # start -> its barriers
    withheld: str | None = None  # why groups were asked for and not emitted
    # window -> the latency XLA:GPU's estimator is told for its collective (seconds)
    seconds: Mapping[int, float] = field(default_factory=dict)
    in_flight: int = 0  # the most collectives the schedule has in flight at once (0: not pinned)

    @property
    def windows(self) -> int:
        """The windows marked in the program (held in place or not)."""
        return len(set(self.marks.values()))

    def compiler_options(self) -> dict[str, int]:
        """XLA:GPU options for compiling the pinned step: as many collectives in flight at
        once as the schedule has (XLA's own limit, one by default, closes a window before the
        schedule closes it whenever the schedule has more open)."""
        return {OVERLAP_LIMIT_OPTION: self.in_flight} if self.in_flight else {}

    def describe(self) -> str:
        if self.attribute == GROUP_ATTRIBUTE:
            return "as scheduling groups"
        if not self.pins:
            return "not pinned"
        return f"pinned by barriers, up to {self.in_flight} collectives in flight"


def target_platform(mesh: Any) -> str:
    """The platform the step is emitted for: its mesh's devices' (``gpu`` also for an
    ahead-of-time GPU topology)."""
    return mesh.devices.flat[0].platform


def most_in_flight(graph: Graph, order: Sequence[int]) -> int:
    """The most split collectives ``order`` has started and not yet finished at once."""
    open_now = most = 0
    for node in order:
        role = graph.nodes[node].role
        if role is Role.START:
            open_now += 1
            most = max(most, open_now)
        elif role is Role.DONE:
            open_now -= 1
    return most


def pin_windows(
    graph: Graph,
    order: Order,
    how: str,
    op_seconds: Callable[[Op], float] | None = None,
) -> Pinning:
    """The pinning ``how`` names (``barriers``, ``groups`` or ``none``) of ``order``:
    groups only where the compiler is not known to mishandle them
    (:func:`~scheduling.program.jax_adapter.xla_groups_withheld`). Without groups, every
    window is marked with its number all the same (a frontend attribute XLA ignores), so
    that the compiled order can be read against the schedule, pinned or not. With
    ``op_seconds`` (the schedule's time of an op), barriers carry each window's latency for
    XLA:GPU's latency estimator (:mod:`scheduling.runtime.xla_latencies`).

    Barriers and marks are for XLA:GPU only: XLA:CPU runs every collective synchronously
    in an order of its own, where barriers would hold nothing and only change how it
    fuses (and so, by a rounding, what it computes)."""
    platform = target_platform(graph.program.mesh)
    if how == "groups":
        withheld = jax_adapter.xla_groups_withheld(platform)
        if withheld:
            return Pinning(GROUP_ATTRIBUTE, withheld=withheld)
        return Pinning(GROUP_ATTRIBUTE, scheduling_groups(graph, order.nodes))
    if platform != "gpu":
        return Pinning()
    pins = window_pins(graph, order.nodes)
    marks = {}
    for start, pin in pins.items():
        for node in (start, graph.nodes[start].partner, *pin.members):
            marks[node] = pin.index  # a node in nested windows: the innermost
    if how != "barriers":
        return Pinning(WINDOW_ATTRIBUTE, marks)
    seconds = window_latencies(graph, len(pins), op_seconds) if op_seconds and pins else {}
    in_flight = most_in_flight(graph, order.nodes) if pins else 0
    return Pinning(WINDOW_ATTRIBUTE, marks, pins, seconds=seconds, in_flight=in_flight)
