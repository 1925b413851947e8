"""Prefetch: start each gather of sharded weights only as early as it takes to hide it.

A collective's start runs as soon as its operand exists (:mod:`.order`). For the gathers
of sharded weights (ZeRO-3, under :data:`~scheduling.names.PARAMETER_GATHER_SCOPE`) that
is the start of the step, whose arguments they read: every block's weights would be
gathered at once and held until used, which is what sharding them avoids. Here each such
gather gets an earliest position instead. Walking back from its first consumer in program
order, the compute before it is added up until it reaches ``lead`` times the gather's
estimated time; the start runs no earlier than there, nor later than the gathers needed
after it start: the link serves gathers in the order they start, so a small gather that
needs little lead would otherwise wait behind a large one needed later. The prefetch
depth thus follows the cost model: a slow link or small blocks prefetch further ahead,
and each block of lead holds one more block's gathered weights. A gather whose operand
is made later than that (a backward pass's second gather, behind its recomputation's
barrier) starts after it, as any collective does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduling.names import PARAMETER_GATHER_SCOPE
from scheduling.program.capture import aval_bytes
from scheduling.program.graph import Graph, Node, Role


def is_parameter_gather(node: Node) -> bool:
    return node.op.primitive == "all_gather" and PARAMETER_GATHER_SCOPE in node.op.name_stack


def prefetch_bounds(graph: Graph, seconds: Callable[[Node], float], lead: float) -> dict[int, int]:
    """``{start node: the compute node it runs no earlier than}`` for every parameter
    gather's start (module docstring); none with ``lead`` 0 (as early as possible)."""
    if lead <= 0:
        return {}
    bounds = {}
    for start in graph.starts():
        if not is_parameter_gather(start):
            continue
        consumers = graph.succs[start.partner]
        if not consumers:
            continue
        need = lead * seconds(start)
        covered, earliest = 0.0, min(consumers)
        while covered < need and earliest > 0:
            earliest -= 1
            node = graph.nodes[earliest]
            if node.role is Role.COMPUTE and not node.is_collective:
                covered += seconds(node)
        bounds[start.id] = earliest
    # The link serves gathers in the order they start: one needed sooner starts no later
    # than one needed after it, or it waits behind that one's transfer.
    needed = sorted(bounds, key=lambda start: (min(graph.succs[graph.nodes[start].partner]), start))
    sooner = len(graph.nodes)
    for start in reversed(needed):
        sooner = bounds[start] = min(bounds[start], sooner)
    return bounds


def gathers_in_flight_bytes(graph: Graph, order: Sequence[int]) -> int:
    """The most bytes of gathered weights held at once before their use when running in
    ``order``: each split parameter gather's result from its start to its first consumer
    (0 where no such gather is split into a start and a done). What a schedule's early
    starts add to the gathered weights of an unscheduled step, at most."""
    position = {node: i for i, node in enumerate(order)}
    change = [0] * (len(order) + 1)
    for start in graph.starts():
        consumers = graph.succs[start.partner]
        if not is_parameter_gather(start) or not consumers:
            continue
        size = sum(aval_bytes(value.aval) for value in start.op.outputs)
        change[position[start.id]] += size
        change[min(position[c] for c in consumers)] -= size
    held = most = 0
    for step in change:
        held += step
        most = max(most, held)
    return most
