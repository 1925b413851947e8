"""Transports: how an emitted program runs its collectives, behind one interface.

The emitter (:mod:`scheduling.runtime.emit`) walks the planned order and hands every
node to a :class:`Transport`: the start of a split collective, its done, or any other
op to run where it stands. Three transports exist (``SchedulePolicy.transport``):

- ``xla``: XLA's async collectives, a start and a done primitive per split collective
  (through the adapter). On GPU the latency-hiding scheduler places them; XLA:CPU runs
  each pair synchronously.
- ``sync``: the planned order with synchronous collectives, each run at its start (for
  a JAX whose async primitives the adapter does not know).
- ``socket``: on the CPU backend across processes, the all-to-alls as socket start/done
  host callbacks (:mod:`scheduling.runtime.socket_all_to_all`), the planned order pinned
  by data dependence, so that they overlap the computation planned between them; the
  other collectives as ``xla``. An all-to-all the plan left whole runs on the sockets
  too, its done right after its start, so that every schedule is measured on one
  transport. Elsewhere (another backend, one process) ``socket`` is ``xla``. The pieces
  of a ragged exchange (an ``all_to_all`` under a ``ragged_rows`` scope) are sent trimmed
  to their routed rows.

A transport object lives for one trace of the step: :func:`connect` returns a factory
that makes a fresh one each time the step is traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
from jax.sharding import Mesh

from scheduling.costs.cost_model import is_ragged_exchange
from scheduling.program import jax_adapter
from scheduling.program.capture import Op
from scheduling.runtime.socket_all_to_all import EmittedOrder, SocketTransport


class Transport(Protocol):
    def start(self, node: int, op: Op, operand: Any) -> None:
        """Start the collective ``op`` (node ``node``) on ``operand``."""

    def done(self, start: int, op: Op) -> list[Any]:
        """The results of the collective started at node ``start``."""

    def run(self, node: int, op: Op, inputs: list[Any]) -> list[Any]:
        """Run ``op``, not split into start and done, where it stands."""


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
    """The planned order with synchronous collectives: each runs at its start."""

    def __init__(self) -> None:
        self._results: dict[int, list[Any]] = {}

    def start(self, node: int, op: Op, operand: Any) -> None:
        self._results[node] = jax_adapter.bind_equation(op.eqn, [operand])

    def done(self, start: int, op: Op) -> list[Any]:
        return self._results.pop(start)

    def run(self, node: int, op: Op, inputs: list[Any]) -> list[Any]:
        return jax_adapter.bind_equation(op.eqn, inputs)


class SocketAllToAlls:
    """All-to-alls over the sockets of ``connection``; every other collective through
    ``others``. Every op's inputs are pinned after the starts the plan puts before it."""

    def __init__(self, connection: SocketTransport, others: Transport):
        self._sockets = EmittedOrder(connection)
        self._others = others

    def _carries(self, op: Op, operand: Any) -> bool:
        return self._sockets.supports(
            op.primitive, op.eqn.params, operand, op.outputs[0].aval.shape
        )

    def start(self, node: int, op: Op, operand: Any) -> None:
        if self._carries(op, operand):
            self._sockets.start(node, operand, op.eqn.params, is_ragged_exchange(op))
        else:
            self._others.start(node, op, operand)

    def done(self, start: int, op: Op) -> list[Any]:
        if self._sockets.is_pending(start):
            return [self._sockets.done(start)]
        return self._others.done(start, op)

    def run(self, node: int, op: Op, inputs: list[Any]) -> list[Any]:
        if op.primitive == "all_to_all" and len(inputs) == 1 and self._carries(op, inputs[0]):
            # An all-to-all the plan left whole (schedule "none"): synchronous, on sockets.
            return [self._sockets.now(node, inputs[0], op.eqn.params, is_ragged_exchange(op))]
        results = self._others.run(node, op, self._sockets.pin(op.primitive, inputs))
        self._sockets.record(results)
        return results


def connect(kind: str, mesh: Mesh, link_mbit: float | None = None) -> Callable[[], Transport]:
    """A factory of transports of ``kind`` (``xla``, ``sync`` or ``socket``) for ``mesh``.

    ``socket`` connects every process of the run (all of them must call this); where it
    does not apply (another backend than CPU, one process) it is ``xla``. ``link_mbit``:
    the link's rate between processes, which bounds how long a socket done waits (default:
    the transport's). ``xla`` on a JAX whose async primitives the adapter does not know
    raises :class:`~scheduling.program.jax_adapter.AsyncCollectivesUnavailable`.
    """
    if kind == "sync":
        return Synchronous
    jax_adapter.require_async_collectives()
    if kind == "socket" and socket_applies():
        connection = SocketTransport.connect(mesh, link_mbit=link_mbit)
        return lambda: SocketAllToAlls(connection, XlaAsync())
    return XlaAsync


def socket_applies() -> bool:
    """Whether socket all-to-alls help here: the CPU backend, more than one process."""
    return jax.default_backend() == "cpu" and jax.process_count() > 1
