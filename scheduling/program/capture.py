"""Capture: trace a step function into one flat per-device program.

The step is traced under a ``shard_map`` over the whole mesh (all axes manual);
the body of that ``shard_map`` is the per-device program. Call-like equations
(``jit``, ``closed_call`` or ``eval_jaxpr``, ``custom_jvp_call``, ``custom_vjp_call``,
remat) are inlined recursively, so every collective and every piece of computation is
a top-level op; annotations for autodiff (``checkpoint_name``) are dropped, each result
its operand, as they are once differentiated. Control flow (``scan``, ``while``,
``cond``) and any other equation that carries a sub-program stays one opaque op: the
scheduler moves it as a whole (a collective inside it stays synchronous; the report
lists such ops). Only the forward partition looks into a ``scan``, to cut it along the
batch (:mod:`scheduling.program.batch_layout`).

Remat bodies are inlined like the others, so that the collectives in them are
visible. Where JAX's lowering puts an ``optimization_barrier`` on a
recomputation's inputs (a differentiated body with ``prevent_cse``), capture
adds that barrier as an op before the inlined body: without it XLA merges the
recomputation with the forward values it repeats, and keeps them alive again.

Each op keeps where it came from: the layer (its name stack with the AD
transforms stripped, e.g. ``layer_3/moe``) and the phase. AD writes the
phase into the name stack: ``jvp(...)`` is the forward pass and
``transpose(jvp(...))`` the backward pass (a recomputation inlined from a remat
body of the backward pass carries that stack, so it is backward too); ops
outside AD that depend on the backward pass (gradient reduction, clipping, the
optimizer update) are the optimizer phase. The remaining ops outside AD —
before it, or after it but not fed by the backward pass (e.g. reducing the
loss for a metric) — are labelled forward.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import Mesh

from scheduling.program import jax_adapter

COLLECTIVES = frozenset(
    {
        "all_to_all",
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "ppermute",
        "all_gather",
        "reduce_scatter",
    }
)


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


_ids = itertools.count()


@dataclass(frozen=True, eq=False)
class Value:
    """One value of the program (an SSA variable). Identity is the object."""

    aval: Any
    id: int = field(default_factory=lambda: next(_ids))

    def __repr__(self) -> str:
        return f"v{self.id}:{self.aval.str_short()}"


@dataclass(frozen=True, eq=False)
class Constant:
    """A literal or closed-over constant operand."""

    value: Any
    aval: Any


Atom = Value | Constant


def aval_bytes(aval: Any) -> int:
    """Size in bytes of a value of type ``aval`` (0 for tokens and other non-arrays)."""
    dtype = getattr(aval, "dtype", None)
    return 0 if dtype is None else math.prod(aval.shape) * dtype.itemsize


@dataclass(eq=False)
class Op:
    """One equation of the flat program."""

    index: int
    eqn: Any  # the original JaxprEqn: primitive, params and context for re-binding
    inputs: tuple[Atom, ...]
    outputs: tuple[Value, ...]
    name_stack: str
    phase: Phase = Phase.FORWARD

    # Read for every op by every pass: looked up once (an op's equation never changes).
    @functools.cached_property
    def primitive(self) -> str:
        return self.eqn.primitive.name

    @property
    def layer(self) -> str:
        """The name stack without AD transforms.

        ``transpose(jvp(layer_1))/moe`` becomes ``layer_1/moe``.
        """
        return jax_adapter.without_transforms(self.name_stack)

    @functools.cached_property
    def is_collective(self) -> bool:
        return self.primitive in COLLECTIVES

    @property
    def is_opaque(self) -> bool:
        """Carries a sub-program (control flow) that the scheduler does not look into.

        A scatter's ``update_jaxpr`` only combines two scalars; it is not a sub-program.
        """
        return jax_adapter.carries_subprogram(self.eqn)

    def bind(self, operands: Sequence[Any]) -> list[Any]:
        """This op's equation applied to ``operands`` (arrays or tracers)."""
        return jax_adapter.bind_equation(self.eqn, operands)

    def __repr__(self) -> str:
        return f"Op({self.index}: {self.primitive} [{self.phase.value}] {self.layer})"


@dataclass
class Program:
    """The per-device program of a whole-mesh ``shard_map`` step."""

    ops: list[Op]
    inputs: list[Value]  # per-device arguments, in flattened argument order
    outputs: list[Atom]
    mesh: Mesh
    in_specs: tuple[Any, ...]  # one PartitionSpec per flattened argument
    out_specs: tuple[Any, ...]  # one PartitionSpec per flattened result
    in_tree: Any
    out_tree: Any

    def collectives(self) -> list[Op]:
        return [op for op in self.ops if op.is_collective]


def _join_stacks(outer: str, inner: str) -> str:
    return "/".join(part for part in (outer, inner) if part)


def _barrier_equation(avals: Sequence[Any]) -> Any:
    """An ``optimization_barrier`` equation over values of ``avals``."""
    operands = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals)
    (eqn,) = jax.make_jaxpr(jax.lax.optimization_barrier)(operands).jaxpr.eqns
    return eqn


class _Flattener:
    """Inlines nested bodies into one list of ops over fresh :class:`Value` objects."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def atom(self, env: dict[Any, Atom], var: Any) -> Atom:
        if isinstance(var, jcore.Literal):
            return Constant(var.val, var.aval)
        return env[var]

    def run(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Atom], stack: str
    ) -> list[Atom]:
        env: dict[Any, Atom] = {}
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = Constant(value, var.aval)
        for var, arg in zip(jaxpr.invars, args, strict=True):
            env[var] = arg
        for eqn in jaxpr.eqns:
            inputs = [self.atom(env, var) for var in eqn.invars]
            if jax_adapter.is_annotation(eqn):
                env.update(zip(eqn.outvars, inputs, strict=True))
                continue
            eqn_stack = _join_stacks(stack, str(eqn.source_info.name_stack))
            body = jax_adapter.inlined_body(eqn)
            if body is not None:
                if jax_adapter.recomputes_behind_a_barrier(eqn):
                    inputs = self.barrier(inputs, eqn_stack)
                results = self.run(body[0], body[1], inputs, eqn_stack)
                for var, result in zip(eqn.outvars, results, strict=True):
                    env[var] = result
                continue
            outputs = tuple(Value(var.aval) for var in eqn.outvars)
            for var, value in zip(eqn.outvars, outputs, strict=True):
                env[var] = value
            self.ops.append(Op(len(self.ops), eqn, tuple(inputs), outputs, eqn_stack))
        return [self.atom(env, var) for var in jaxpr.outvars]

    def barrier(self, inputs: Sequence[Atom], stack: str) -> list[Atom]:
        """``inputs`` with each value passed through one ``optimization_barrier`` op."""
        values = list(dict.fromkeys(a for a in inputs if isinstance(a, Value)))
        if not values:
            return list(inputs)
        eqn = _barrier_equation([value.aval for value in values])
        outputs = tuple(Value(value.aval) for value in values)
        self.ops.append(Op(len(self.ops), eqn, tuple(values), outputs, stack))
        behind = dict(zip(values, outputs, strict=True))
        return [behind.get(a, a) for a in inputs]


def inline_jaxpr(
    closed: Any, args: Sequence[Atom], name_stack: str, phase: Phase
) -> tuple[list[Op], list[Atom]]:
    """The equations of ``closed`` (a ClosedJaxpr) as ops over ``args``, all in ``phase``."""
    flattener = _Flattener()
    outputs = flattener.run(closed.jaxpr, closed.consts, list(args), name_stack)
    for op in flattener.ops:
        op.phase = phase
    return flattener.ops, outputs


def _assign_phases(ops: list[Op]) -> None:
    after_backward: set[Value] = set()
    for op in ops:
        differentiated = jax_adapter.ad_pass(op.name_stack)
        if differentiated == "backward":
            op.phase = Phase.BACKWARD
        elif differentiated == "forward":
            op.phase = Phase.FORWARD
        elif any(isinstance(a, Value) and a in after_backward for a in op.inputs):
            op.phase = Phase.OPTIMIZER
        else:
            op.phase = Phase.FORWARD
        if op.phase is not Phase.FORWARD:
            after_backward.update(op.outputs)


def capture(
    step_fn: Callable[..., Any],
    *example_args: Any,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
) -> Program:
    """Trace ``step_fn`` (written per device) under a whole-mesh ``shard_map``.

    ``example_args`` may be arrays or ``jax.ShapeDtypeStruct``s with global shapes.
    """
    mapped = jax.shard_map(
        step_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    closed, out_shapes = jax.make_jaxpr(mapped, return_shape=True)(*example_args)
    if len(closed.jaxpr.eqns) != 1:
        raise ValueError("capture expects the traced step to be exactly one whole-mesh shard_map")
    (eqn,) = closed.jaxpr.eqns
    body, eqn_in_specs, eqn_out_specs = jax_adapter.shard_map_parts(eqn)
    outer_consts = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))

    flattener = _Flattener()
    inputs = [Value(var.aval) for var in body.invars]
    body_args: list[Atom] = []
    for outer_var, value in zip(eqn.invars, inputs, strict=True):
        # Constants closed over by the step enter the shard_map replicated.
        const = outer_consts.get(outer_var)
        body_args.append(value if const is None else Constant(const, value.aval))
    outputs = flattener.run(body, (), body_args, "")
    _assign_phases(flattener.ops)

    # The shard_map's operands are the step's flattened arguments (in the order of the
    # outer jaxpr's inputs), plus any hoisted constants.
    position = {var: i for i, var in enumerate(closed.jaxpr.invars)}
    arguments = sorted(
        (position[outer_var], value, spec)
        for outer_var, value, spec in zip(eqn.invars, inputs, eqn_in_specs, strict=True)
        if outer_var not in outer_consts
    )
    argument_inputs = [value for _, value, _ in arguments]
    argument_specs = tuple(spec for _, _, spec in arguments)
    return Program(
        ops=flattener.ops,
        inputs=argument_inputs,
        outputs=outputs,
        mesh=mesh,
        in_specs=argument_specs,
        out_specs=tuple(eqn_out_specs),
        in_tree=jax.tree.structure(example_args),
        out_tree=jax.tree.structure(out_shapes),
    )
