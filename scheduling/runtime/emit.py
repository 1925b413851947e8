"""Emit: rebuild a jit-compiled step that runs the program in the planned order.

The per-device program is re-evaluated op by op, in schedule order, inside a
new whole-mesh ``shard_map`` under ``jax.jit``, every node through a transport
(:mod:`scheduling.runtime.transports`): with XLA's, a split collective binds
the async start primitive at its start and the done primitive at its done.
Each critical window that can be one — a collective's start, the matrix products the
plan runs in it, and its done — is traced under
``set_xla_metadata(_scheduling_group_id=K)``, which XLA's GPU latency-hiding
scheduler reads as "schedule these together" (:mod:`scheduling.runtime.xla_groups`
says what XLA accepts in a group, why the rest of a window is left to XLA's scheduler,
and where XLA drops the groups). The XLA flags that turn that scheduler on are given by
:func:`xla_gpu_flags`; a compiled step's ``windows`` says what the compiled order kept.

On the CPU backend, where XLA runs every async pair synchronously, the socket
transport carries the all-to-alls between processes instead, so that they overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental.xla_metadata import set_xla_metadata

from scheduling import names
from scheduling.passes.order import Schedule
from scheduling.program import jax_adapter
from scheduling.program.capture import Constant, Program, Value
from scheduling.program.graph import Graph, Role
from scheduling.reports.hlo_windows import KeptWindows, kept_windows
from scheduling.runtime import transports
from scheduling.runtime.transports import Transport, XlaAsync
from scheduling.runtime.xla_groups import scheduling_groups


def xla_gpu_flags() -> list[str]:
    """XLA flags under which the GPU compiler keeps the planned windows."""
    return list(names.XLA_GPU_FLAGS)


def per_device_function(
    graph: Graph,
    schedule: Schedule,
    transport: Callable[[], Transport] = XlaAsync,
    groups: Mapping[int, int] | None = None,
):
    """A function of the flattened per-device arguments that runs ``schedule``, every node
    through a fresh transport from ``transport`` (:mod:`scheduling.runtime.transports`),
    each node of ``groups`` (node -> group, from
    :func:`~scheduling.runtime.xla_groups.scheduling_groups`) traced in its XLA
    scheduling group."""
    program = graph.program
    groups = groups or {}

    def run(*flat_args: Any) -> tuple[Any, ...]:
        env: dict[Value, Any] = dict(zip(program.inputs, flat_args, strict=True))
        carrier = transport()

        def read(atom: Value | Constant) -> Any:
            return atom.value if isinstance(atom, Constant) else env[atom]

        for node_id in schedule.order:
            node = graph.nodes[node_id]
            op = node.op
            group = groups.get(node_id)
            scope = (
                set_xla_metadata(_scheduling_group_id=group)
                if group is not None
                else contextlib.nullcontext()
            )
            with scope, jax_adapter.traced_as(op.eqn, op.name_stack):
                if node.role is Role.START:
                    (operand,) = (read(a) for a in op.inputs)
                    carrier.start(node_id, op, operand)
                    continue
                if node.role is Role.DONE:
                    results = carrier.done(node.partner, op)
                else:
                    results = carrier.run(node_id, op, [read(a) for a in op.inputs])
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
        groups: int = 0,
        groups_withheld: str | None = None,
    ):
        self.program = program
        self.groups = groups  # the scheduling groups it is emitted with
        self.groups_withheld = groups_withheld  # why none were, where XLA mishandles them
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
        """Compile ahead of time; the result is called like the step itself."""
        return CompiledStep(self, self.lower(*args).compile())


class CompiledStep:
    """A compiled :class:`ScheduledStep`: called like the original step; ``as_text`` is
    the optimized HLO module (on GPU, in the order the compiler scheduled it), and
    ``windows`` what that order kept of the planned windows."""

    def __init__(self, step: ScheduledStep, compiled: Any):
        self._step = step
        self._compiled = compiled

    def __call__(self, *args: Any) -> Any:
        outputs = self._compiled(*self._step._flatten(args))
        return jax.tree.unflatten(self._step.program.out_tree, outputs)

    def as_text(self) -> str:
        return self._compiled.as_text()

    def windows(self) -> KeptWindows:
        """The planned windows (scheduling groups) the compiled order kept."""
        return kept_windows(self._step.groups, self.as_text(), self._step.groups_withheld)


def emit(
    graph: Graph,
    schedule: Schedule,
    *,
    donate_argnums: Sequence[int] = (),
    transport: Callable[[], Transport] | None = None,
    xla_groups: bool = True,
) -> ScheduledStep:
    """A jit-compiled step running ``schedule``, its collectives through ``transport``
    (a factory from :func:`scheduling.runtime.transports.connect`; default: XLA's async
    collectives, which raises
    :class:`~scheduling.program.jax_adapter.AsyncCollectivesUnavailable` on a JAX whose
    async primitives the adapter does not know). ``xla_groups``: trace the windows as
    scheduling groups (:mod:`scheduling.runtime.xla_groups`), except on a platform whose
    compiler is known to mishandle them
    (:func:`~scheduling.program.jax_adapter.xla_groups_withheld`); False leaves the order
    on GPU to XLA's latency-hiding scheduler.
    """
    mesh = graph.program.mesh
    if transport is None:
        transport = transports.connect("xla", mesh)
    platform = mesh.devices.flat[0].platform
    withheld = jax_adapter.xla_groups_withheld(platform) if xla_groups else None
    groups = scheduling_groups(graph, schedule.order) if xla_groups and not withheld else {}
    run = per_device_function(graph, schedule, transport, groups)
    count = len(set(groups.values()))
    return ScheduledStep(graph.program, run, donate_argnums, count, withheld)
