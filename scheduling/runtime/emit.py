"""Emit: rebuild a jit-compiled step that runs the program in the scheduled order.

The per-device program is re-evaluated op by op, in schedule order, inside a
new whole-mesh ``shard_map`` under ``jax.jit``, every node through a transport
(:mod:`scheduling.runtime.transports`): with XLA's, a split collective binds
the async start primitive at its start and the done primitive at its done.

The traced order is not what XLA:GPU runs: its latency-hiding scheduler orders the
module by its own cost model. Each critical window with computation in it is therefore
pinned (:mod:`scheduling.runtime.pinning`): by default between two optimization barriers
(:mod:`scheduling.runtime.xla_barriers`), data dependences every XLA pass keeps; or as
an XLA scheduling group (:mod:`scheduling.runtime.xla_groups`, which says where XLA
drops or mishandles them). The XLA flags that turn that scheduler on are given by
:func:`xla_gpu_flags`; a compiled step's ``windows`` says what the compiled order kept.

On the CPU backend XLA runs every async pair synchronously; a transport of one's own
(:class:`~scheduling.runtime.transports.Transport`, such as the emulated cluster's
socket all-to-alls) can carry the collectives instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.xla_metadata import set_xla_metadata

from scheduling import names
from scheduling.order.list_scheduler import Order
from scheduling.program import jax_adapter
from scheduling.program.capture import Constant, Op, Program, Value
from scheduling.program.graph import Graph, Role
from scheduling.runtime import pinning, transports
from scheduling.runtime.hlo_windows import KeptWindows, kept_windows, window_scope
from scheduling.runtime.pinning import Pinning
from scheduling.runtime.transports import Transport, XlaAsync
from scheduling.runtime.xla_latencies import compile_with_latencies


def xla_gpu_flags() -> list[str]:
    """XLA flags under which the GPU compiler keeps the scheduled windows."""
    return list(names.XLA_GPU_FLAGS)


def per_device_function(
    graph: Graph,
    order: Order,
    transport: Callable[[], Transport] = XlaAsync,
    pinned: Pinning | None = None,
):
    """A function of the flattened per-device arguments that runs ``order``, every node
    through a fresh transport from ``transport`` (:mod:`scheduling.runtime.transports`),
    its windows pinned as ``pinned`` says (default: not at all)."""
    program = graph.program
    pinned = pinned or Pinning()

    def scoped(name_stack: str, mark: int | None) -> str:
        """A pinned collective's name stack, its window's scope added (XLA:GPU keeps an
        async collective's op_name, not its frontend attributes)."""
        if mark is None:
            return name_stack
        return "/".join(filter(None, (name_stack, window_scope(pinned.attribute, mark))))

    def run(*flat_args: Any) -> tuple[Any, ...]:
        env: dict[Value, Any] = dict(zip(program.inputs, flat_args, strict=True))
        bound: dict[int, dict[Value, Any]] = {}  # a window member's inputs, past its barrier
        carrier = transport()

        def read(atom: Value | Constant, node_id: int | None = None) -> Any:
            if isinstance(atom, Constant):
                return atom.value
            return bound.get(node_id, {}).get(atom, env[atom])

        for node_id in order.nodes:
            node = graph.nodes[node_id]
            op = node.op
            mark = pinned.marks.get(node_id)
            scope = (
                set_xla_metadata(**{pinned.attribute: mark})
                if mark is not None
                else contextlib.nullcontext()
            )
            if node.role is Role.START:
                (operand,) = (read(a) for a in op.inputs)
                pin = pinned.pins.get(node_id)
                if pin is not None:  # the window's computation waits for the operand
                    operand, before = jax.lax.optimization_barrier(
                        (operand, [read(v) for v in pin.before])
                    )
                    passed = dict(zip(pin.before, before, strict=True))
                    for member in pin.members:
                        bound.setdefault(member, {}).update(passed)
                with scope, jax_adapter.traced_as(op.eqn, scoped(op.name_stack, mark)):
                    carrier.start(node_id, op, operand)
                continue
            stack = scoped(op.name_stack, mark) if node.role is Role.DONE else op.name_stack
            with scope, jax_adapter.traced_as(op.eqn, stack):
                if node.role is Role.DONE:
                    results = carrier.done(node.partner, op)
                else:
                    results = carrier.run(node_id, op, [read(a, node_id) for a in op.inputs])
            pin = pinned.pins.get(node.partner) if node.role is Role.DONE else None
            if pin is not None:  # the result's readers wait for the window's computation
                results, after = jax.lax.optimization_barrier(
                    (results, [read(v) for v in pin.after])
                )
                env.update(zip(pin.after, after, strict=True))
            for value, result in zip(op.outputs, results, strict=True):
                env[value] = result
        return tuple(read(atom) for atom in program.outputs)

    return run


class ScheduledStep:
    """The emitted step: call it like the original; ``lower`` gives its StableHLO."""

    def __init__(
        self,
        program: Program,
        run,
        donate_argnums: Sequence[int] = (),
        pinned: Pinning | None = None,
    ):
        self.program = program
        self.pinned = pinned or Pinning()  # how its windows are held in place
        leaves_per_arg = [child.num_leaves for child in program.in_tree.children()]
        offsets = [sum(leaves_per_arg[:i]) for i in range(len(leaves_per_arg))]
        donated = tuple(
            offsets[arg] + leaf for arg in donate_argnums for leaf in range(leaves_per_arg[arg])
        )
        mapped = jax.shard_map(
            run,
            mesh=program.mesh,
            in_specs=program.in_specs,
            out_specs=program.out_specs,
            check_vma=False,
        )
        self._jitted = jax.jit(mapped, donate_argnums=donated)

    def _flatten(self, args: tuple[Any, ...]) -> list[Any]:
        flat, tree = jax.tree.flatten(args)
        if tree != self.program.in_tree:
            raise TypeError(
                "the scheduled step was captured for arguments of structure "
                f"{self.program.in_tree}, but was called with {tree}"
            )
        return flat

    def __call__(self, *args: Any) -> Any:
        outputs = self._jitted(*self._flatten(args))
        return jax.tree.unflatten(self.program.out_tree, outputs)

    def lower(self, *args: Any):
        """Lower for arguments like ``args`` (arrays or ``jax.ShapeDtypeStruct``s)."""
        return self._jitted.lower(*self._flatten(args))

    def compile(self, *args: Any) -> CompiledStep:
        """Compile ahead of time; the result is called like the step itself. For a GPU,
        with the pinning's compiler options (as many collectives in flight as the schedule
        has) and its windows' latencies (:mod:`scheduling.runtime.xla_latencies`):
        compiled once to name the windows' starts, then again with their latencies."""
        lowered = self.lower(*args)
        if pinning.target_platform(self.program.mesh) != "gpu":
            return CompiledStep(self, lowered.compile())
        options = self.pinned.compiler_options()
        return CompiledStep(self, compile_with_latencies(lowered, self.pinned.seconds, options))


class CompiledStep:
    """A compiled :class:`ScheduledStep`: called like the original step; ``as_text`` is
    the optimized HLO module (on GPU, in the order the compiler scheduled it), and
    ``windows`` what that order kept of the scheduled windows."""

    def __init__(self, step: ScheduledStep, compiled: Any):
        self._step = step
        self._compiled = compiled

    def __call__(self, *args: Any) -> Any:
        outputs = self._compiled(*self._step._flatten(args))
        return jax.tree.unflatten(self._step.program.out_tree, outputs)

    def as_text(self) -> str:
        return self._compiled.as_text()

    def windows(self) -> KeptWindows:
        """The scheduled windows (scheduling groups) the compiled order kept."""
        pinned = self._step.pinned
        return kept_windows(pinned.windows, self.as_text(), pinned.describe(), pinned.withheld)


def emit(
    graph: Graph,
    order: Order,
    *,
    donate_argnums: Sequence[int] = (),
    transport: Callable[[], Transport] | None = None,
    xla_pin: str = "barriers",
    op_seconds: Callable[[Op], float] | None = None,
) -> ScheduledStep:
    """A jit-compiled step running ``order``, its collectives through ``transport``
    (a factory from :func:`scheduling.runtime.transports.connect`; default: XLA's async
    collectives, which raises
    :class:`~scheduling.program.jax_adapter.AsyncCollectivesUnavailable` on a JAX whose
    async primitives the adapter does not know), its windows pinned as ``xla_pin`` says
    (:func:`~scheduling.runtime.pinning.pin_windows`: ``barriers``, ``groups`` or
    ``none``, which leaves the order on GPU to XLA's latency-hiding scheduler).
    ``op_seconds``: the schedule's time of an op, from which a barrier-pinned step for GPU
    tells XLA's latency estimator its windows' latencies when compiled ahead.
    """
    if transport is None:
        transport = transports.connect("xla", graph.program.mesh)
    pinned = pinning.pin_windows(graph, order, xla_pin, op_seconds)
    run = per_device_function(graph, order, transport, pinned)
    return ScheduledStep(graph.program, run, donate_argnums, pinned)
