"""Bytes per device at the peak of a training step, from its per-device program as XLA
holds it (the state alone, from its shapes and specs: :mod:`jaxmoe.plan.state_memory`).

**The step** (:func:`step_memory`): the captured per-device program walked in an order
XLA may run it, the bytes of the buffers alive after each op summed; the peak is the
step's memory. What gets a buffer, and for how long, follows what XLA does with the
program:

- *Fusion.* A value gets no buffer when XLA fuses it into every op that reads it: an
  elementwise, layout or slicing op's value whose readers all take fused operands and
  which is cheap or read once (:func:`scheduling.fuses_into_readers`, the rule the cost
  model prices kernels by). Its operands then stay alive until its readers run. The
  rest (matmuls, collectives, updates in place, and what they read) get buffers.
- *Aliases.* ``reduce_precision`` to a dtype's own precision (what JAX puts on the values
  a remat region saves) is the identity, and so is a sum with zeros
  (:func:`scheduling.sum_with_zeros`). ``optimization_barrier`` passes its operands
  through, and makes them buffers. ``dynamic_update_slice`` and the scatters
  (:data:`scheduling.IN_PLACE`) write into their operand's buffer where nothing reads
  the operand after them, and so does an elementwise op into an operand of its result's
  type (XLA's buffer assignment shares them: a gradient summed into a stack row by row,
  or a running sum, holds one buffer).
- *Common subexpressions.* An op that repeats an earlier one (the same primitive,
  parameters and operands) is merged into it, as XLA's CSE does; what is behind a barrier
  is never the same as what is in front of it, so a recomputation (``model.recompute``,
  ZeRO-3's second gather of a block) stays one, in the backward pass.
- *Backends.* XLA:GPU, and XLA:CPU from jax 0.11.2, keep the barriers through CSE,
  fusion and scheduling (XLA:CPU removes them after it has scheduled the step). XLA:CPU
  up to jax 0.10.2 removed them before CSE, which then merged a recomputation with the
  forward values it repeats, so that recomputation saved nothing on CPU;
  ``keeps_barriers=False`` walks that compilation. XLA:CPU also computes bfloat16
  matmuls in float32 (it converts their operands), which this walk does not model: on
  CPU a bfloat16 step takes more memory than the walk says.
- *Order.* The walk runs each op as soon as its operands are ready, forward ops first.
  From six microbatches on, a microbatch's forward pass waits for the backward pass of
  the microbatch :data:`~scheduling.names.MICROBATCHES_IN_FLIGHT` before it
  (:mod:`jaxmoe.pipeline.microbatches`), and nothing else orders them: up to that many
  microbatches' activations are alive, and gradient accumulation over more microbatches
  holds fewer rows; fewer microbatches run their forward passes first. XLA:CPU holds
  somewhat more than the walk of an ordered step (it runs the passes in another order;
  ``tests/plan/test_memory.py`` bounds it).
  A pipeline's ticks (:data:`~jaxmoe.pipeline.ticks.TICK_SCOPE`) are walked
  in their order, each tick's forward slot before its backward slot, as the schedule
  runs them: a stage holds a microbatch's residuals from its forward slot to its
  backward slot, at most as many microbatches as the schedule has in flight. XLA is
  free to run them otherwise: nothing makes a tick's forward slot wait for the previous
  tick's backward slot, and XLA:CPU runs forward slots early. On 2 stages it holds
  between this walk and the walk with every forward slot as many ticks ahead as a stage
  has chunks (``ticks_ahead``; tested on 1F1B, with ZeRO-1 and interleaved, where it
  holds up to 8% more than this walk with jax 0.12.0.1); the forward-first order bounds
  it from above.

At the peak the live buffers are counted by kind (:class:`StepMemory`). The walk is
checked against XLA:CPU's compiled memory analysis in ``tests/plan/test_memory.py``.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

import scheduling.names
from jaxmoe.parallel.zero import GATHER_SCOPE
from jaxmoe.pipeline.ticks import TICK_SCOPE
from jaxmoe.train.state import (
    TrainState,
)
from scheduling import (
    FUSIBLE,
    IN_PLACE,
    Phase,
    Program,
    ProgramMemo,
    Value,
    aval_bytes,
    fuses_into_readers,
    sum_with_zeros,
    zero_values,
)

_IDENTITIES = frozenset({"reduce_precision"})
_BARRIER = "optimization_barrier"
_RANDOM = frozenset({"random_bits", "random_seed", "random_wrap", "rng_bit_generator"})
# A recomputation's ops: JAX names the forward pass it runs again in the backward pass so.
_RECOMPUTED = "rematted_computation"
_MICROBATCH = re.compile(scheduling.names.MICROBATCH_SCOPE.format(r"(\d+)"))
_TICK = re.compile(r"(?:^|/)" + TICK_SCOPE.format(r"(\d+)") + r"(?:/|$)")


@dataclass(frozen=True)
class StepMemory:
    """Bytes per device at the peak of a train step (module docstring).

    The state (``master``: the parameters as the state holds them, float32 or ZeRO's
    shards; ``optimizer``: everything else in it) and the batch are there throughout; the
    rest are the buffers alive at the peak: ``parameters`` the parameters as the step
    computes with them (casts to the compute dtype, ZeRO's gathers), ``activations`` the
    forward values (a recomputation's included), ``backward`` the backward pass's and the
    update's values (gradients, their accumulators, working buffers), ``pipeline`` the
    values other pipeline stages sent (``ppermute``)."""

    master: int
    optimizer: int
    batch: int
    parameters: int
    activations: int
    backward: int
    pipeline: int
    microbatches_in_flight: int  # microbatches with activations alive at the peak

    @property
    def total(self) -> int:
        return (
            self.master
            + self.optimizer
            + self.batch
            + self.parameters
            + self.activations
            + self.backward
            + self.pipeline
        )

    @property
    def activations_per_microbatch(self) -> int:
        return self.activations // max(1, self.microbatches_in_flight)

    def to_json(self) -> dict[str, int]:
        return {
            **dataclasses.asdict(self),
            "activations_per_microbatch": self.activations_per_microbatch,
            "total": self.total,
        }


@dataclass(eq=False)
class _Step:
    """An op of the walk: what it reads (aliases resolved) and the buffers it makes."""

    op: Any
    reads: tuple[Value, ...]
    makes: tuple[Value, ...]


def step_memory(
    program: Program, state: TrainState, *, keeps_barriers: bool = True, ticks_ahead: int = 0
) -> StepMemory:
    """The peak bytes per device of the captured train step ``program``, whose first
    argument has the structure of ``state`` (module docstring). ``keeps_barriers``: the
    compilation of XLA:GPU and of XLA:CPU from jax 0.11.2 (True), or one that drops the
    barriers before CSE, as XLA:CPU up to jax 0.10.2 did (False). ``ticks_ahead``: a
    pipeline's forward slots walked that many ticks early (each before the backward slot
    of the tick that many before its own)."""
    walk = _Walk(program, state, keeps_barriers, ticks_ahead)
    peak, at_peak = -1, set()
    for _, live, size in walk.run():
        if size > peak:
            peak, at_peak = size, set(live)
    return _by_kind(at_peak, walk.steps, program, walk.state_leaves, state)


@dataclass(frozen=True)
class BackwardStart:
    """What the walk of :func:`step_memory` holds as the backward pass begins (its first
    op): each buffer a forward op made (``kept``: whether under a name scope the caller's
    ``scope`` matches), and the most bytes the backward pass holds beyond those alive then
    before its first op in ``scope`` (``transient``: the loss's and the head's backward
    passes, while every block's saved values are alive)."""

    kept: dict[Value, bool]
    transient: int

    def bytes(self, leaving_out: Collection[Value] = ()) -> tuple[int, int]:
        """The bytes kept, all of them and those in ``scope`` (``leaving_out`` these)."""
        values = [(v, in_scope) for v, in_scope in self.kept.items() if v not in leaving_out]
        return (
            sum(aval_bytes(v.aval) for v, _ in values),
            sum(aval_bytes(v.aval) for v, in_scope in values if in_scope),
        )


def backward_start(
    program: Program, state: TrainState, scope: re.Pattern[str], *, keeps_barriers: bool = True
) -> BackwardStart:
    """What is alive when the backward pass of ``program`` begins, in one walk
    (:class:`BackwardStart`)."""
    walk = _Walk(program, state, keeps_barriers)
    forward = {
        value: bool(scope.search(step.op.layer))
        for step in walk.steps
        if step.op.phase is Phase.FORWARD
        for value in step.makes
    }
    kept: dict[Value, bool] | None = None
    start = most = 0
    for step, live, size in walk.run():
        if step.op.phase is not Phase.BACKWARD:
            continue
        if kept is None:
            kept = {value: forward[value] for value in live if value in forward}
            start = size
        if scope.search(step.op.layer):
            break
        most = max(most, size - start)
    return BackwardStart(kept or {}, most)


def recomputed_for_backward(
    program: Program, state: TrainState, *, keeps_barriers: bool = True
) -> dict[Value, Any]:
    """The buffers that recomputations make (JAX names their ops ``rematted_computation``)
    and that the rest of the backward pass reads, in the walk of :func:`step_memory`: what
    the forward pass would keep for the backward pass without the recomputation, where
    no barrier stands in front of it (a value is a buffer here as its readers other than
    barriers make it one). Each with the op that made it."""
    walk = _Walk(program, state, keeps_barriers)
    outputs = _walked(program, keeps_barriers).outputs
    unbarred = [
        _Step(step.op, (), step.makes) if step.op.primitive == _BARRIER else step
        for step in walk.steps
    ]
    buffers = _buffers(unbarred, program, set(outputs))
    made = {
        value: step.op
        for step in walk.steps
        if _RECOMPUTED in step.op.name_stack
        for value in step.makes
        if value in buffers
    }
    read: dict[Value, Any] = {}
    for step in walk.steps:
        if step.op.phase is Phase.BACKWARD and _RECOMPUTED not in step.op.name_stack:
            for value in step.reads:
                if value in made:
                    read[value] = made[value]
    return read


class _Walk:
    """The walk of :func:`step_memory`: the steps in order, the buffers alive after each."""

    def __init__(
        self, program: Program, state: TrainState, keeps_barriers: bool, ticks_ahead: int = 0
    ):
        self.state_leaves = sum(len(jax.tree.leaves(field)) for field in state)
        if self.state_leaves >= len(program.inputs):
            raise ValueError("the program's inputs are not (state, batch)")
        self.program = program
        walked = _walked(program, keeps_barriers)
        self.steps, outputs = walked.steps, walked.outputs
        # The step's arguments stay alive throughout (XLA does not free them); the new
        # state is written over the old (the state is donated): no buffer of its own.
        new_state = set(outputs[: self.state_leaves]) - set(program.inputs)
        self.buffers = walked.buffers - new_state
        self.order = walked.order(ticks_ahead)
        self.last_read = _last_reads(self.order, self.buffers, set(outputs) | set(program.inputs))

    def run(self) -> Iterator[tuple[_Step, set[Value], int]]:
        """Each step in order, with the buffers alive while it runs and their bytes."""
        ending: dict[int, list[Value]] = {}
        for value, position in self.last_read.items():
            ending.setdefault(position, []).append(value)
        live = {value for value in self.program.inputs if value in self.last_read}
        size = sum(aval_bytes(value.aval) for value in live)
        for position, step in enumerate(self.order):
            made = [value for value in step.makes if value in self.buffers]
            operand = self._shared(step, position, live) if made else None
            if operand is not None:  # the result is written into the operand's buffer
                live.discard(operand)
                size -= aval_bytes(operand.aval)
            live.update(made)
            size += sum(aval_bytes(value.aval) for value in made)
            yield step, live, size
            for value in ending.get(position, ()):
                if value in live:
                    live.discard(value)
                    size -= aval_bytes(value.aval)
            for value in made:
                if value not in self.last_read:  # made and never read
                    live.discard(value)
                    size -= aval_bytes(value.aval)

    def _shared(self, step: _Step, position: int, live: set[Value]) -> Value | None:
        """The operand whose buffer ``step``'s result takes, if any: the first operand of
        an update in place, or an operand of an elementwise op of the result's type, that
        nothing reads after ``step`` (XLA's buffer assignment shares them)."""
        if step.op.primitive in IN_PLACE:  # their result takes the first operand's buffer
            candidates = step.reads[:1]
        elif step.op.primitive in FUSIBLE and len(step.makes) == 1:
            result = step.makes[0].aval
            candidates = tuple(
                value for value in step.reads
                if value.aval.shape == result.shape and value.aval.dtype == result.dtype
            )  # fmt: skip
        else:
            return None
        for operand in candidates:
            if operand in live and self.last_read.get(operand) == position:
                return operand
        return None


@dataclass(eq=False)
class _Walked:
    """What every walk of a program starts from: its steps, outputs and buffers, and the
    orders walked so far (by ``ticks_ahead``)."""

    steps: list[_Step]
    outputs: list[Value]
    buffers: set[Value]
    orders: dict[int, list[_Step]]

    def order(self, ticks_ahead: int) -> list[_Step]:
        if ticks_ahead not in self.orders:
            self.orders[ticks_ahead] = _forward_first(self.steps, ticks_ahead)
        return self.orders[ticks_ahead]


# The programs walked last: a plan walks each traced program several times (its peak, the
# backward pass's start, the recomputations), and no walk changes them.
_WALKED: ProgramMemo[_Walked] = ProgramMemo(kept=8)


def _walked(program: Program, keeps_barriers: bool) -> _Walked:
    """The steps of ``program`` (:func:`_walk_steps`) and the values that get buffers."""

    def walk() -> _Walked:
        steps, outputs = _walk_steps(program, keeps_barriers)
        return _Walked(steps, outputs, _buffers(steps, program, set(outputs)), {})

    return _WALKED.get(program, keeps_barriers, walk)


def _walk_steps(program: Program, keeps_barriers: bool) -> tuple[list[_Step], list[Value]]:
    """The program's ops with aliases resolved: identities and barriers forward their
    operands; an op that repeats an earlier one (same primitive, parameters and operands)
    is merged into it, where a kept barrier's results are new values (nothing behind it
    merges with what is in front of it)."""
    alias: dict[Value, Value] = {}  # the buffer that holds a value
    same: dict[Value, Value] = {}  # the value it equals, as XLA's CSE compares them
    seen: dict[Any, tuple[Value, ...]] = {}

    def resolved(atom: Any) -> Any:
        return alias.get(atom, atom) if isinstance(atom, Value) else atom

    def compared(atom: Any) -> Any:
        return same.get(atom, atom) if isinstance(atom, Value) else atom

    zeros = zero_values(program.ops)
    steps = []
    for op in program.ops:
        reads = tuple(resolved(a) for a in op.inputs if isinstance(a, Value))
        name = op.primitive
        kept = sum_with_zeros(op, zeros)
        if isinstance(kept, Value):  # XLA takes the sum for ``kept``
            alias[op.outputs[0]] = resolved(kept)
            same[op.outputs[0]] = compared(kept)
            steps.append(_Step(op, (), ()))
            continue
        if name in _IDENTITIES or name == _BARRIER:
            # A kept barrier reads its operands (they become buffers); it makes nothing,
            # but what is behind it is new to CSE.
            kept = name == _BARRIER and keeps_barriers
            for source, value in zip(op.inputs, op.outputs, strict=True):
                if isinstance(source, Value):
                    alias[value] = resolved(source)
                    if not kept:
                        same[value] = compared(source)
            steps.append(_Step(op, reads if kept else (), ()))
            continue
        if name not in _RANDOM:
            key = _equation_key(op, compared)
            if key is not None and key in seen:
                for value, earlier in zip(op.outputs, seen[key], strict=True):
                    alias[value] = earlier
                    same[value] = earlier
                steps.append(_Step(op, (), ()))
                continue
            if key is not None:
                seen[key] = op.outputs
        steps.append(_Step(op, reads, op.outputs))
    outputs = [resolved(a) for a in program.outputs if isinstance(a, Value)]
    return steps, outputs


def _equation_key(op: Any, resolved: Any) -> Any:
    """What makes two ops compute the same values, or None where it cannot be told."""
    operands = []
    for atom in op.inputs:
        atom = resolved(atom)
        if isinstance(atom, Value):
            operands.append(atom.id)
        elif getattr(atom.aval, "shape", None) == ():
            value = np.asarray(atom.value)
            operands.append(("literal", value.dtype.str, value.tobytes(), atom.aval))
        else:
            operands.append(("constant", id(atom.value)))
    params = _params_text(op.eqn)
    return None if params is None else (op.primitive, params, tuple(operands))


# Each equation's parameters as text, made once: a plan walks each traced program several
# times (the step, the backward pass's start, the recomputations).
_PARAMS: dict[int, tuple[Any, str | None]] = {}
_PARAMS_KEPT = 200_000


def _params_text(eqn: Any) -> str | None:
    found = _PARAMS.get(id(eqn))
    if found is None or found[0] is not eqn:
        try:
            text = repr(sorted(eqn.params.items()))
        except TypeError:
            text = None
        if len(_PARAMS) >= _PARAMS_KEPT:
            _PARAMS.clear()
        found = _PARAMS[id(eqn)] = (eqn, text)
    return found[1]


def _buffers(steps: Sequence[_Step], program: Program, outputs: set[Value]) -> set[Value]:
    """The values that get buffers: every input and output, and each op's values unless
    XLA fuses them into all their readers."""
    readers: dict[Value, list[str]] = {}
    for step in steps:
        for value in step.reads:
            readers.setdefault(value, []).append(step.op.primitive)
    buffers = set(program.inputs) | outputs
    for step in steps:
        for value in step.makes:
            if not fuses_into_readers(
                step.op.primitive, getattr(value.aval, "dtype", None), readers.get(value, [])
            ):
                buffers.add(value)
    return buffers


def _last_reads(order: Sequence[_Step], buffers: set[Value], to_the_end: set[Value]) -> dict:
    """For each buffer, the position in ``order`` of the last step that needs it (a fused
    value's readers need its operands; ``to_the_end``: needed after the last step)."""
    needed: dict[Value, int] = {}
    for position in range(len(order) - 1, -1, -1):
        step = order[position]
        when = position
        for value in step.makes:
            if value not in buffers:
                when = max(when, needed.get(value, position))
        for value in step.reads:
            needed[value] = max(needed.get(value, -1), when)
    for value in to_the_end:
        needed[value] = len(order)
    return {value: when for value, when in needed.items() if value in buffers}


def _walk_key(op: Any, ticks_ahead: int = 0) -> tuple[int, int, int]:
    """Where ``op`` comes in the walk among the ops that are ready (module docstring):
    forward ops outside a pipeline's ticks, the ticks in order (a tick's forward ops
    before its backward ops, then the sums of its gradients; the forward ops of tick
    ``t`` just before the backward ops of tick ``t - ticks_ahead``), backward ops outside
    the ticks, the update."""
    rank = {Phase.FORWARD: 0, Phase.BACKWARD: 2, Phase.OPTIMIZER: 3}[op.phase]
    tick = _TICK.search(op.layer)
    if tick is not None:  # its gradients' sums included
        if op.phase is Phase.FORWARD and ticks_ahead:
            return (1, int(tick.group(1)) - ticks_ahead, 1)
        return (1, int(tick.group(1)), rank)
    return ({Phase.FORWARD: 0, Phase.BACKWARD: 2, Phase.OPTIMIZER: 3}[op.phase], 0, rank)


def _forward_first(steps: Sequence[_Step], ticks_ahead: int = 0) -> list[_Step]:
    """The steps in a dependency order that runs each one as soon as its operands are
    ready, forward ops before backward ops before the update, a pipeline's ticks in
    their order (module docstring; ``ticks_ahead``: see :func:`_walk_key`)."""
    made_by = {value: i for i, step in enumerate(steps) for value in step.op.outputs}
    waiting = [0] * len(steps)
    users: list[list[int]] = [[] for _ in steps]
    for i, step in enumerate(steps):
        sources = {made_by[a] for a in step.op.inputs if isinstance(a, Value) and a in made_by}
        waiting[i] = len(sources)
        for source in sources:
            users[source].append(i)
    keys = [_walk_key(step.op, ticks_ahead) for step in steps]
    ready = [(keys[i], i) for i in range(len(steps)) if not waiting[i]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(steps[i])
        for user in users[i]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, (keys[user], user))
    return order


def _by_kind(
    live: set[Value],
    steps: Sequence[_Step],
    program: Program,
    state_leaves: int,
    state: TrainState,
) -> StepMemory:
    counts = [len(jax.tree.leaves(field)) for field in state]
    kinds: dict[Value, str] = {}
    offset = 0
    for name, count in zip(TrainState._fields, counts, strict=True):
        for value in program.inputs[offset : offset + count]:
            kinds[value] = "master" if name == "params" else "optimizer"
        offset += count
    for value in program.inputs[state_leaves:]:
        kinds[value] = "batch"
    microbatches = set()
    for step in steps:
        op = step.op
        kind = _value_kind(op, kinds)
        for value in step.makes:
            kinds[value] = kind
            if kind == "activations" and value in live:
                found = _MICROBATCH.search(op.layer)
                microbatches.add(found.group(1) if found else None)
    totals = dict.fromkeys(
        ("master", "optimizer", "batch", "parameters", "activations", "backward", "pipeline"), 0
    )
    for value in live:
        totals[kinds[value]] += aval_bytes(value.aval)
    # Activations outside any microbatch's scope (one microbatch: no scope) count as one.
    in_flight = len(microbatches - {None}) or int(bool(microbatches))
    return StepMemory(**totals, microbatches_in_flight=in_flight)


def _value_kind(op: Any, kinds: dict[Value, str]) -> str:
    """What the values of ``op`` hold (see :class:`StepMemory`)."""
    if op.primitive == "ppermute":
        return "pipeline"
    if GATHER_SCOPE in op.layer and op.primitive == "all_gather":
        return "parameters"
    if op.primitive == "convert_element_type":
        (source,) = [a for a in op.inputs if isinstance(a, Value)] or [None]
        if source is not None and kinds.get(source) in ("master", "parameters"):
            return "parameters"
    if op.phase is Phase.FORWARD or _RECOMPUTED in op.name_stack:
        return "activations"
    return "backward"
