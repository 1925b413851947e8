"""Transports: how an emitted program runs its collectives, behind one interface.

The emitter (:mod:`scheduling.runtime.emit`) walks the scheduled order and hands every
node to a :class:`Transport`: the start of a split collective, its done, or any other
op to run where it stands. Two transports are the library's (``SchedulePolicy.transport``):

- ``xla``: XLA's async collectives, a start and a done primitive per split collective
  (through the adapter). On GPU the latency-hiding scheduler places them; XLA:CPU runs
  each pair synchronously.
- ``sync``: the scheduled order with synchronous collectives, each run at its start (for
  a JAX whose async primitives the adapter does not know).

A transport object lives for one trace of the step: :func:`connect` returns a factory
that makes a fresh one each time the step is traced. A transport of one's own plugs in
the same way, as an experimental option (``ExperimentalOptions.transport``): a
:data:`Connector`, called with the mesh, returns its factory. The emulated cluster's
socket all-to-alls, which let CPU processes overlap their exchanges, are one (outside
this package: the research harness's); :class:`XlaAsync` is what such a transport hands
the collectives it does not carry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from jax.sharding import Mesh

from scheduling.program import jax_adapter
from scheduling.program.capture import Op


class Transport(Protocol):
    """How an emitted step runs its collectives, node by node, in the scheduled order."""

    def start(self, node: int, op: Op, operand: Any) -> None:
        """Start the collective ``op`` (node ``node``) on ``operand``."""

    def done(self, start: int, op: Op) -> list[Any]:
        """The results of the collective started at node ``start``."""

    def run(self, node: int, op: Op, inputs: list[Any]) -> list[Any]:
        """Run ``op``, not split into start and done, where it stands."""


# A connector: called with the step's mesh (by every process of the run at once), the
# factory of the transports its emitted step traces its collectives through.
Connector = Callable[[Mesh], Callable[[], Transport]]


class XlaAsync:
    """XLA's async collective primitives: a start and a done per split collective."""

    def __init__(self) -> None:
        self._futures: dict[int, Any] = {}

    def start(self, node: int, op: Op, operand: Any) -> None:
        self._futures[node] = jax_adapter.bind_start(op.primitive, operand, op.eqn.params)

    def done(self, start: int, op: Op) -> list[Any]:
        return [jax_adapter.bind_done(op.primitive, self._futures.pop(start))]

    def run(self, node: int, op: Op, inputs: list[Any]) -> list[Any]:
        return jax_adapter.bind_equation(op.eqn, inputs)


class Synchronous:
    """The scheduled order with synchronous collectives: each runs at its start."""

    def __init__(self) -> None:
        self._results: dict[int, list[Any]] = {}

    def start(self, node: int, op: Op, operand: Any) -> None:
        self._results[node] = jax_adapter.bind_equation(op.eqn, [operand])

    def done(self, start: int, op: Op) -> list[Any]:
        return self._results.pop(start)

    def run(self, node: int, op: Op, inputs: list[Any]) -> list[Any]:
        return jax_adapter.bind_equation(op.eqn, inputs)


def connect(kind: str, mesh: Mesh) -> Callable[[], Transport]:
    """A factory of transports of ``kind`` (``xla`` or ``sync``) for ``mesh``.

    ``xla`` on a JAX whose async primitives the adapter does not know raises
    :class:`~scheduling.program.jax_adapter.AsyncCollectivesUnavailable`.
    """
    if kind == "sync":
        return Synchronous
    if kind != "xla":
        raise ValueError(f"transport {kind!r}: choose xla or sync")
    jax_adapter.require_async_collectives()
    return XlaAsync
