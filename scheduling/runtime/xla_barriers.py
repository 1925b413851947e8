"""The scheduled windows pinned with optimization barriers, which XLA's schedulers keep.

A scheduled window is a critical collective's start, its done, and the computation the
schedule runs between them (:func:`~scheduling.runtime.xla_groups.window_nodes`). XLA:GPU's
latency-hiding scheduler orders a module by its own cost model whatever order it was
traced in, and the scheduling groups that would pin a window are dropped or mishandled
by the XLA builds measured (:mod:`scheduling.runtime.xla_groups`). What no XLA pass
reorders across is a data dependence, and ``jax.lax.optimization_barrier`` makes one
between values that have none: each of its results waits for all of its operands. Two
barriers bound a window:

- at its start, the collective's operand passes one barrier with the values the
  window's computation reads that exist by then: that computation cannot run before the
  collective could be issued;
- at its done, the collective's result passes another with the values the window's
  computation leaves for anything outside it (a collective opened inside the window
  included): nothing that reads the collective's result can run before that
  computation has finished.

Between the two, the window's computation is what the scheduler has to hide the
collective behind, and it places it inside; the compiled order says whether it did
(:mod:`scheduling.runtime.hlo_windows`, through the :data:`WINDOW_ATTRIBUTE` each
pinned node is traced with). A barrier computes nothing: results are bit for bit those
of the unpinned program. Deferrable collectives (gradient reductions) are not pinned, so
that the scheduler may still move them off the link the critical path needs; nor is a
window with no computation in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduling.program.capture import Value
from scheduling.program.graph import Graph, Role
from scheduling.runtime.xla_groups import window_nodes

# The frontend attribute each pinned node is traced with (the window's index): XLA
# ignores it and keeps it on the instructions it compiles them to, which is how the
# compiled order is read back.
WINDOW_ATTRIBUTE = "_scheduled_window"


@dataclass(frozen=True)
class Pin:
    """The barriers of one window, keyed in :func:`window_pins` by its start's node."""

    index: int  # the window's number, in the order of the starts
    members: tuple[int, ...]  # the compute nodes the schedule runs inside
    before: tuple[Value, ...]  # read by the members and defined before the start
    after: tuple[Value, ...]  # defined by the members and read outside the window


def window_pins(graph: Graph, order: Sequence[int]) -> dict[int, Pin]:
    """The pin of every critical window of ``order`` with computation inside."""
    position = {node: i for i, node in enumerate(order)}
    defined_at = {}  # value -> position of the node that defines it (inputs: none)
    readers: dict[Value, set[int]] = {}  # value -> the nodes reading it (outputs: -1)
    for node in graph.nodes:
        if node.role is not Role.START:  # a split collective's results come at its done
            for value in node.op.outputs:
                defined_at[value] = position[node.id]
        if node.role is not Role.DONE:  # ... and its operand is read at its start
            for atom in node.op.inputs:
                if isinstance(atom, Value):
                    readers.setdefault(atom, set()).add(node.id)
    for atom in graph.program.outputs:
        if isinstance(atom, Value):
            readers.setdefault(atom, set()).add(-1)

    pins: dict[int, Pin] = {}
    for start, members in window_nodes(graph, order).items():
        if start in graph.deferrable or not members:
            continue
        opened, inside = position[start], set(members)
        before: dict[Value, None] = {}
        after: dict[Value, None] = {}
        for member in members:
            op = graph.nodes[member].op
            for atom in op.inputs:
                if isinstance(atom, Value) and defined_at.get(atom, -1) < opened:
                    before[atom] = None
            for value in op.outputs:
                if readers.get(value, set()) - inside:
                    after[value] = None
        pins[start] = Pin(len(pins), tuple(members), tuple(before), tuple(after))
    return pins
