"""The emulated cluster as the simulator sees it: costs measured on it, and four readings.

``experiments.simulator_validation`` predicts the cluster's steps with it.

Costs (``instrument_cost``), measured, not fitted to steps:

- ops: each distinct op timed on every device of the step's mesh at once in one process
  (the host processes share the machine's cores; ``scheduling.OpProfiler``); layout ops
  are free, elementwise ops cost their memory traffic (XLA fuses them);
- collectives: an all-to-all over the socket transport, with one device per host, sends
  ``(group - 1) / group`` of its operand out of each host over that host's own shaped link
  (each direction is shaped on its own), so it costs what the link calibration's size
  sweep measured for that many bytes; XLA's collectives (the gradient reductions, over
  gloo) cost what ``jaxmoe link-curves`` measured on the same link
  (``experiments.cluster --sweep``).

Readings of one program and order (``readings``), by the two-stream simulator:

- ``instrument``: split all-to-alls overlap (the socket pairs do), every other collective
  runs where its start stands (XLA:CPU runs its own async pairs synchronously);
- ``scaled``: the same, with every op's cost times one factor, the measured compute-only
  step of ``none`` over its predicted compute: the overlap model with the op costs set
  right as a whole (one fitted number), to tell its errors from the op profiler's;
- ``all_async``: every split collective overlaps (a GPU-like backend);
- ``in_place``: nothing overlaps.

Readings from inside the step (``traced_readings``), where each schedule's step was
traced on the unshaped link (``experiments.cluster --traces``): every op's cost is its
time in that trace, every collective's host work (the socket callbacks' copies, XLA's
collectives' fixed costs) is its time there too (``scheduling.traced_costs``), and the
link adds what the calibration's size sweep measured for the bytes each collective puts
on the wire:

- ``traced``: split all-to-alls overlap, every other collective runs where it stands;
- ``traced_no_host``: the same without the collectives' host work (what it adds);
- ``traced_in_place``: nothing overlaps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

READINGS = ("instrument", "scaled", "all_async", "in_place")
TRACED_READINGS = ("traced", "traced_no_host", "traced_in_place")


def socket_all_to_all_samples(sweep: list[dict], group: int) -> list[tuple[float, float]]:
    """``(operand bytes, seconds)`` of a socket all-to-all over ``group`` hosts of one device
    each, from the points ``{"bytes", "seconds"}`` of the link calibration's sweep."""
    return [(point["bytes"] * group / (group - 1), point["seconds"]) for point in sweep]


def instrument_cost(mesh, curves_path: Path, calibration: dict, cache: Path):
    """The cost model of the cluster whose measurements are given (see the module)."""
    from scheduling import (
        PROFILES,
        CollectiveCurves,
        OpProfiler,
        PiecewiseLinear,
        ProfiledCostModel,
    )

    instrument = replace(PROFILES["cpu"], name="emulated cluster", fused_elementwise=True)
    curves = CollectiveCurves.load(curves_path)
    group = mesh.devices.size
    samples = socket_all_to_all_samples(calibration["sweep"], group)
    curves.curves[("all_to_all", group)] = PiecewiseLinear.fit(samples)
    profiler = OpProfiler(cache, mesh=mesh)
    return ProfiledCostModel(instrument, dict(mesh.shape), profiler, curves)


def scaled_compute(seconds: Callable, factor: float) -> Callable:
    """``seconds`` with every computation's cost times ``factor`` (collectives unchanged)."""

    def scaled(node) -> float:
        cost = seconds(node)
        return cost if node.is_collective else cost * factor

    return scaled


def readings(graph, order: list[int], seconds: Callable, factor: float) -> dict[str, dict]:
    """The program's step under each reading (``factor``: the ``scaled`` one's), and what
    its all-to-alls and its other collectives cost on the link."""
    from scheduling import Role, simulate

    def sockets_overlap(node) -> bool:
        return node.op.primitive == "all_to_all"

    cases = {
        "instrument": (sockets_overlap, seconds),
        "scaled": (sockets_overlap, scaled_compute(seconds, factor)),
        "all_async": (True, seconds),
        "in_place": (False, seconds),
    }
    result: dict = {}
    for kind in ("all_to_all", "other_collectives"):  # their costs on the link, summed
        result[f"{kind}_s"] = sum(
            seconds(node)
            for node in graph.nodes
            if node.is_collective
            and node.role is not Role.DONE
            and (node.op.primitive == "all_to_all") == (kind == "all_to_all")
        )
    for name, (asynchronous, costs) in cases.items():
        result[name] = _figures(simulate(graph, order, costs, asynchronous=asynchronous))
    return result


def _figures(timeline) -> dict[str, float]:
    """What a reading records of its simulated timeline."""
    return {
        "step_s": timeline.step_seconds,
        "compute_s": timeline.compute_seconds,
        "communication_s": timeline.communication_seconds,
        "exposed_s": timeline.exposed_communication_seconds,
    }


def pipelined_order(graph) -> list[int]:
    """The order in which the control's socket forms run
    (``experiments.emulation.overlap_control``): with the all-to-alls' starts S0..Sk-1 in
    program order, S0 and what it needs, then for each i: S(i+1) and what it needs, the
    work that became ready at D(i-1), and D(i). A chained form serialises itself: S(i+1)
    needs D(i)."""
    from scheduling import Role

    placed: set[int] = set()
    order: list[int] = []

    def add(nodes) -> None:
        for node in sorted(nodes):
            if node not in placed:
                placed.add(node)
                order.append(node)

    def with_ancestors(node: int) -> list[int]:
        mask, ancestors = graph.ancestors[node], []
        while mask:
            low = mask & -mask
            ancestors.append(low.bit_length() - 1)
            mask ^= low
        return [*ancestors, node]

    def ready_after(done: int) -> list[int]:
        ready = []
        for node in range(len(graph.nodes)):  # ids are a topological order
            ok = graph.has_path(done, node) and graph.nodes[node].role is Role.COMPUTE
            if ok and node not in placed and graph.preds[node] <= placed | set(ready):
                ready.append(node)
        return ready

    starts = [node.id for node in graph.nodes if node.role is Role.START]
    add(with_ancestors(starts[0]))
    for i, start in enumerate(starts):
        if i + 1 < len(starts):
            add(with_ancestors(starts[i + 1]))
        if i > 0:
            add(ready_after(graph.nodes[starts[i - 1]].partner))
        add([graph.nodes[start].partner])
    add(range(len(graph.nodes)))
    return order


def link_seconds(calibration: dict, axis_sizes: dict[str, int]):
    """Seconds a collective holds the shaped link: the calibration sweep's time for the
    bytes it puts on the wire (``scheduling``'s wire bytes; a message of those bytes)."""
    from scheduling import PiecewiseLinear, collective_wire_bytes

    curve = PiecewiseLinear.fit((p["bytes"], p["seconds"]) for p in calibration["sweep"])

    def seconds(node) -> float:
        wire = collective_wire_bytes(node.op, axis_sizes)
        return curve(wire) if wire > 0 else 0.0

    return seconds


def traced_readings(graph, order: list[int], costs, link) -> dict[str, dict]:
    """The program's step under each traced reading (``costs``: a ``TracedCosts`` of its
    trace; ``link``: ``link_seconds``), and the traced figures it was built from."""
    from scheduling import simulate

    def sockets_overlap(node) -> bool:
        return node.op.primitive == "all_to_all"

    seconds = costs.seconds(link)
    cases = {
        "traced": (sockets_overlap, costs.host_seconds),
        "traced_no_host": (sockets_overlap, None),
        "traced_in_place": (False, costs.host_seconds),
    }
    result: dict = {
        "traced_step_s": costs.traced_step_s,
        "traced_compute_s": sum(costs.compute.values()),
        "traced_host_s": sum(costs.host.values()),
        "unattributed_s": costs.unattributed_s,
        "between_ops_s": costs.between_ops_s,
        "link_s": sum(seconds(node) for node in graph.nodes if node.is_collective),
    }
    for name, (asynchronous, host) in cases.items():
        timeline = simulate(graph, order, seconds, asynchronous=asynchronous, host=host)
        result[name] = _figures(timeline)
    return result
