"""Split each collective the emitter can run asynchronously into a start and a done node.

A graph is read, never changed, by the passes after it, and the schedules of one program
(each one a planner prices, and the range search's unpartitioned candidate) split it
alike: the graphs of the programs seen last are kept and made once."""

from __future__ import annotations

import math
from collections.abc import Iterable

from jax.sharding import Mesh

from scheduling.program import jax_adapter
from scheduling.program.capture import Op, Program, aval_bytes
from scheduling.program.collective_purpose import collective_axes
from scheduling.program.graph import Graph
from scheduling.program.program_memo import ProgramMemo

# Collectives that XLA's combiners merge when they stay synchronous; ``min_bytes``
# applies to these only. An all-to-all is never combined, and a partitioned range
# makes small ones on purpose: they must stay async to overlap.
COMBINABLE = frozenset({"psum", "psum_invariant", "pmax", "pmin", "all_gather", "reduce_scatter"})


def splittable(op: Op) -> bool:
    """Whether ``op`` is a collective with an async start/done form (see the adapter)."""
    return op.is_collective and jax_adapter.can_start_async(
        op.primitive, op.eqn.params, len(op.inputs)
    )


def moves_data(op: Op, mesh: Mesh) -> bool:
    """Whether the collective ``op`` exchanges anything: its named axes span more than one
    device. One over axes of size 1 is the identity, which XLA removes; as an async pair it
    would leave XLA:GPU an async computation around a parameter, which its profile-guided
    latency estimator refuses ("Unsupported async done wrapped instruction")."""
    return math.prod(mesh.shape[axis] for axis in collective_axes(op)) > 1


def split_async(program: Program, kinds: Iterable[str] | None = None, min_bytes: int = 0) -> Graph:
    """The program's graph with every splittable collective that moves data (of ``kinds``;
    for combinable ones, with an operand of at least ``min_bytes``) as a pair.

    Without async primitives in this JAX the schedule still has the pairs; the emitter
    then either refuses or binds the synchronous collective (transport ``sync``).
    """
    allowed = None if kinds is None else frozenset(kinds)
    key = (allowed, min_bytes, jax_adapter.async_collectives_available())
    return _GRAPHS.get(program, key, lambda: _split(program, allowed, min_bytes))


def unsplit(program: Program) -> Graph:
    """The program's graph with every collective one synchronous node (made once)."""
    return _GRAPHS.get(program, "unsplit", lambda: Graph(program, split=lambda op: False))


# Few: a graph's reachability sets take about N^2 / 4 bytes for N nodes.
_GRAPHS: ProgramMemo[Graph] = ProgramMemo(kept=2)


def _split(program: Program, allowed: frozenset[str] | None, min_bytes: int) -> Graph:
    def split(op: Op) -> bool:
        if allowed is not None and op.primitive not in allowed:
            return False
        if op.primitive in COMBINABLE and sum(aval_bytes(a.aval) for a in op.inputs) < min_bytes:
            return False
        if op.is_collective and not moves_data(op, program.mesh):
            return False
        if not jax_adapter.async_collectives_available():
            return op.is_collective and len(op.inputs) == 1
        return splittable(op)

    return Graph(program, split)
