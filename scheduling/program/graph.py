"""The dataflow graph of a captured program, with collectives as start/done pairs.

Node ids follow program order (a split collective's start comes just before
its done), so ids are a topological order. Reachability is precomputed as
integer bitsets: ``ancestors[n]`` has bit ``m`` set when there is a path
``m -> n``.

Classification of compute nodes (Lancet's rule). A backward compute node is a
*dW candidate* for a backward all-to-all A when there is no path between it
and A in either direction: it neither feeds A nor needs A's result. Since
only backward nodes qualify, the gradient reduction and the optimizer update
never do. A backward node that is a candidate for at least one backward
all-to-all is classified ``dW``; other backward nodes are ``dX`` (the
activation-gradient chain and what depends on it).

Priority of collectives. A collective is *deferrable* when no forward or
backward computation needs its result: the gradient reductions (only the
optimizer update reads them) and reductions of metrics. The others are on the
critical path: every all-to-all, and the tensor-parallel reductions that the
next layer reads. A runtime that must choose which collective goes next on a
busy link should pick a critical one (see ``scheduling.costs.simulate``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduling.program import jax_adapter
from scheduling.program.capture import Op, Phase, Program, Value


class Role(enum.Enum):
    COMPUTE = "compute"
    START = "start"
    DONE = "done"


class Kind(enum.Enum):
    FORWARD = "forward"
    BACKWARD_DX = "backward-dX"
    BACKWARD_DW = "dW"
    OPTIMIZER = "optimizer"
    COLLECTIVE = "collective"


@dataclass(eq=False)
class Node:
    id: int
    op: Op
    role: Role
    partner: int | None = None  # a start's done, a done's start
    # A start, a done, or a synchronous collective (read for every node of every order).
    is_collective: bool = field(init=False)

    def __post_init__(self):
        self.is_collective = self.role is not Role.COMPUTE or self.op.is_collective

    def __repr__(self) -> str:
        return f"Node({self.id} {self.role.value} {self.op!r})"


def _bits(mask: int) -> list[int]:
    """Indices of the set bits of ``mask``, ascending (read off its binary digits: taking
    the lowest bit off a program-sized integer one at a time copies it each time)."""
    digits = bin(mask)[:1:-1]  # least significant first, without "0b"
    out = []
    index = digits.find("1")
    while index >= 0:
        out.append(index)
        index = digits.find("1", index + 1)
    return out


class Graph:
    """Nodes, edges and reachability of a program.

    ``split`` says which collective ops become a start/done pair; the others stay
    one synchronous node.
    """

    def __init__(self, program: Program, split: Callable[[Op], bool]):
        self.program = program
        self.nodes: list[Node] = []
        producer: dict[Value, int] = {}
        self.preds: list[set[int]] = []
        last_effectful: int | None = None
        for op in program.ops:
            inputs = {producer[a] for a in op.inputs if isinstance(a, Value) and a in producer}
            ordered = jax_adapter.has_ordered_effect(op.eqn)
            if ordered and last_effectful is not None:
                inputs.add(last_effectful)  # ordered effects (e.g. prints) keep program order
            if op.is_collective and split(op):
                first = self._add(op, Role.START, inputs)
                last = self._add(op, Role.DONE, {first})
                self.nodes[first].partner, self.nodes[last].partner = last, first
            else:
                last = self._add(op, Role.COMPUTE, inputs)
            for value in op.outputs:
                producer[value] = last
            if ordered:
                last_effectful = last
        self.producer = producer
        self.succs: list[set[int]] = [set() for _ in self.nodes]
        for node, preds in enumerate(self.preds):
            for pred in preds:
                self.succs[pred].add(node)
        self.ancestors = self._closure(self.preds, range(len(self.nodes)))
        self.descendants = self._closure(self.succs, reversed(range(len(self.nodes))))
        self.kinds = self._classify()
        self.deferrable = self._deferrable()

    def _add(self, op: Op, role: Role, preds: set[int]) -> int:
        self.nodes.append(Node(len(self.nodes), op, role))
        self.preds.append(set(preds))
        return len(self.nodes) - 1

    @staticmethod
    def _closure(edges: list[set[int]], order) -> list[int]:
        reach = [0] * len(edges)
        for node in order:
            mask = 0
            for other in edges[node]:
                mask |= reach[other] | (1 << other)
            reach[node] = mask
        return reach

    # Reachability.

    def has_path(self, source: int, target: int) -> bool:
        return bool(self.ancestors[target] >> source & 1)

    def independent(self, a: int, b: int) -> bool:
        return a != b and not self.has_path(a, b) and not self.has_path(b, a)

    def members(self, mask: int) -> list[int]:
        return _bits(mask)

    # Classification.

    def starts(self) -> list[Node]:
        return [n for n in self.nodes if n.role is Role.START]

    def backward_all_to_alls(self) -> list[Node]:
        """Start nodes of the backward pass's all-to-alls, in launch order."""
        return [
            n
            for n in self.starts()
            if n.op.primitive == "all_to_all" and n.op.phase is Phase.BACKWARD
        ]

    def dw_candidates(self, start: Node) -> int:
        """Bitset of backward compute nodes with no path to or from the collective."""
        done = start.partner
        related = self.ancestors[start.id] | self.descendants[done] | (1 << start.id) | (1 << done)
        return self._backward_compute_mask & ~related

    def _deferrable(self) -> frozenset[int]:
        """Ids of the collective nodes (starts, or synchronous nodes) that are deferrable."""
        training = 0
        for node in self.nodes:
            computes = node.role is Role.COMPUTE and not node.is_collective
            if computes and node.op.phase in (Phase.FORWARD, Phase.BACKWARD):
                training |= 1 << node.id
        deferrable = set()
        for node in self.nodes:
            if node.role is Role.DONE or not node.is_collective:
                continue
            if node.op.primitive == "all_to_all":
                continue
            result = node.partner if node.role is Role.START else node.id
            if not self.descendants[result] & training:
                deferrable.add(node.id)
        return frozenset(deferrable)

    def _classify(self) -> list[Kind]:
        self._backward_compute_mask = 0
        for node in self.nodes:
            if (
                node.role is Role.COMPUTE
                and node.op.phase is Phase.BACKWARD
                and not node.is_collective
            ):
                self._backward_compute_mask |= 1 << node.id
        dw_mask = 0
        for start in self.backward_all_to_alls():
            dw_mask |= self.dw_candidates(start)
        kinds = []
        for node in self.nodes:
            if node.is_collective:
                kinds.append(Kind.COLLECTIVE)
            elif node.op.phase is Phase.FORWARD:
                kinds.append(Kind.FORWARD)
            elif node.op.phase is Phase.OPTIMIZER:
                kinds.append(Kind.OPTIMIZER)
            elif dw_mask >> node.id & 1:
                kinds.append(Kind.BACKWARD_DW)
            else:
                kinds.append(Kind.BACKWARD_DX)
        return kinds
