"""The scheduled windows as scheduling groups that XLA:GPU's latency-hiding scheduler keeps.

An op traced under ``set_xla_metadata(_scheduling_group_id=K)`` joins group K. What the
GPU compiler does with groups (XLA's ``LegalizeSchedulingAnnotations`` and the
latency-hiding scheduler's core) decides what a group may hold:

- a group is scheduled in one go: its instructions run consecutively, nothing else
  between them. A group of a collective's start and done alone therefore runs that
  collective synchronously;
- on GPU only async collectives and matrix products (cuBLAS GEMMs, Triton GEMM fusions)
  keep their annotation; every other instruction loses it;
- a group whose members are joined by a path through an instruction outside the group
  (a "gap") fails compilation, as do two groups that reach each other both ways.

So a critical window (:mod:`scheduling.program.graph`: a collective some computation
waits for) becomes a group of its start, its done and the matrix products the schedule puts
between them that no path joins, the costliest first, and none that would join two
groups both ways. A window with no such product gets no group: XLA's scheduler then
places its start and done as it sees fit, which is better than a synchronous collective.
Deferrable collectives (gradient reductions) are left free as well, so that the
scheduler may move them off the link the critical path needs.

Measured, the groups do not carry the schedule: on an H200 with jax 0.11.2 XLA drops the
attribute when it rewrites JAX's async all-to-all custom calls, and the compiled order is
XLA's own; with jax 0.10.2 XLA crashes on a group over an all-to-all (so the adapter
withholds them there) and keeps other groups without their products
(``docs/architecture.md``). They are one of the emitter's pinnings
(``schedule.xla_pin groups``); the default pins each window between optimization
barriers (:mod:`scheduling.runtime.xla_barriers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduling.costs.cost_model import op_flops
from scheduling.program.graph import Graph, Role

MATRIX_PRODUCTS = frozenset({"dot_general", "ragged_dot_general"})
GROUP_ATTRIBUTE = "_scheduling_group_id"  # the frontend attribute XLA reads a group from


@dataclass
class _Group:
    members: int  # bitset of node ids
    reach: int  # bitset of every node some member reaches

    def add(self, graph: Graph, node: int) -> None:
        self.members |= 1 << node
        self.reach |= graph.descendants[node]


def window_nodes(graph: Graph, order: Sequence[int]) -> dict[int, list[int]]:
    """``start -> compute nodes`` that ``order`` runs between each split collective's
    start and its done, the windows in the order of their starts."""
    position = {node: i for i, node in enumerate(order)}
    starts = sorted((n for n in graph.nodes if n.role is Role.START), key=lambda n: position[n.id])
    return {
        start.id: [
            n
            for n in order[position[start.id] + 1 : position[start.partner]]
            if not graph.nodes[n].is_collective
        ]
        for start in starts
    }


def scheduling_groups(graph: Graph, order: Sequence[int]) -> dict[int, int]:
    """``node id -> group id`` for the start, done and chosen matrix products of each
    critical window of ``order`` that holds one (see the module docstring); a window's
    products are tried costliest (most FLOPs) first."""
    windows = window_nodes(graph, order)
    taken: set[int] = set()
    groups: list[_Group] = []
    chosen: list[tuple[int, list[int]]] = []
    for start, inside in windows.items():
        if start in graph.deferrable:
            continue
        products = [
            n for n in inside if n not in taken and graph.nodes[n].op.primitive in MATRIX_PRODUCTS
        ]
        products.sort(key=lambda n: -op_flops(graph.nodes[n].op))
        done = graph.nodes[start].partner
        group = _Group(0, 0)
        group.add(graph, start)
        group.add(graph, done)
        picked = []
        for product in products:
            if not _joins(graph, group, product) and not _cycles(graph, group, product, groups):
                group.add(graph, product)
                picked.append(product)
        if picked:
            taken.update(picked)
            groups.append(group)
            chosen.append((start, picked))
    result: dict[int, int] = {}
    for index, (start, picked) in enumerate(chosen):
        for node in (start, graph.nodes[start].partner, *picked):
            result[node] = index
    return result


def _joins(graph: Graph, group: _Group, node: int) -> bool:
    """Whether a path joins ``node`` and a member of ``group`` (a gap XLA refuses)."""
    return bool(group.reach >> node & 1) or bool(graph.descendants[node] & group.members)


def _cycles(graph: Graph, group: _Group, node: int, others: list[_Group]) -> bool:
    """Whether adding ``node`` to ``group`` makes it and another group reach each other."""
    members = group.members | 1 << node
    reach = group.reach | graph.descendants[node]
    return any(reach & other.members and other.reach & members for other in others)
