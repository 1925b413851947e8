"""What one shallow trace of a mapping says before the mapping is estimated: lower bounds
of its step time and memory per device, and of those of its variants with other options
(:mod:`jaxmoe.plan.options`).

The mapping's step is traced with one block (or whole, for a model of few blocks) and
each op priced by the cost model. In the ``none`` schedule the simulated step is the sum
of its ops' costs (collectives run where they stand, nothing beside them), so the step of
``n`` blocks is at least the ops outside the block plus ``n`` times the block's own ops:
those in its scope, and the update's ops on its parameters alone (their gradients'
squares and sums in the clipping, their moments and steps), which each further block
adds again. With other schedules communication may hide behind computation, but the
link still runs every collective, one at a time (:mod:`scheduling.costs.simulate`): the
bound is the larger of the computation alone and the link's work. A schedule splits or
moves collectives and drops none, and a collective split into pieces costs no less than
whole (each piece pays the link's latency; a measured curve of the link is taken to grow
no faster than the bytes). Not so where a schedule rewrites exchanges into other
collectives (``comet``): those schedules, and a pipeline's stage, are bounded by the
computation alone.

Time of a variant. One that does less work than the traced options is bounded by taking
away the ops it may not run: with other recomputation, every op of the traced
recomputation (JAX names them ``rematted_computation``); at a lower ZeRO stage, every
parameter gather and the marks JAX puts on the values a fully sharded block keeps (an
all-reduce costs at least the reduce-scatter it replaces). One in more microbatches runs
its forward and backward ops once more per microbatch, each paying at least the
profile's per-op overhead (its collectives carry the same rows in smaller pieces: no less
link work).

A pipeline's stage laid out as the traced step (without a pipeline) runs the same ops for
its chunks' layers over its microbatches, with idle ticks that run the same code on
zeros: the work of the traced step stretched by the idle ticks, and once per tick it
runs in each op's overhead and, in every tick but one, the work of the ops on parameters
alone (casts and transposes of weights, casts and sums of weight gradients: no rows in
them; the first backward slot adds its chunk's gradients to zeros, a sum XLA drops:
:func:`scheduling.sum_with_zeros`). Every stage runs the
embedding, the head and the loss on its microbatches. The update and ZeRO-1's gathers
are of fewer layers over fewer replicas and taken away, but for the optimizer's own ops
where the traced step shards the optimizer: a stage's shards are as large, and the
stage of most blocks holds at least ``1 / stages`` of them.

Memory of a variant. The state (parameters and optimizer state, :func:`jaxmoe.train.
state_memory.memory_per_device`) is there throughout, and when the backward pass begins the
forward values that it reads are alive (:func:`jaxmoe.plan.memory.backward_start`;
gathered or cast parameters aside). A variant that recomputes no more, in as many
microbatches or more, keeps at least their share of those, at any ZeRO stage: up to
:func:`jaxmoe.pipeline.microbatches.in_flight` microbatches' forward passes run before
the first backward pass, each keeping its share of the rows' values; the plain step and
ZeRO-1 keep what differentiation needs, a fully sharded block more. A pipeline's stage walks its
ticks in order, so before each backward slot it keeps at least the residuals of every
forward slot that this slot or a later one reads, each one chunk's on one microbatch (an
idle stage's on zeros). One that
recomputes less keeps more: what the traced recomputation makes again and the backward pass reads
(:func:`jaxmoe.plan.memory.recomputed_for_backward`; the activations' and the norms'
values aside, which a block whose forward values are kept does not keep:
:mod:`jaxmoe.layers.input_kept`), all of it without recomputation, all but the core
attention's (the values from the matmul of queries and keys to the matmul with the
values) when only the core attention is recomputed, and the results of its weight
matmuls and exchanges under ``matmuls`` (which recomputes the rest). Two more are alive
then or soon after: ZeRO-1's gathered parameters (gathered once, held to the backward
pass), and what the head's backward pass makes before the first block's (the logits'
gradients: ``BackwardStart.transient``), on each microbatch's rows.
These bound the
step's peak as :func:`jaxmoe.plan.memory.step_memory` walks it, as far as XLA fuses a
value alike whether it is recomputed or kept; ``tests/plan/test_bounds.py`` checks them
against estimates.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jaxmoe.config.choices import RECOMPUTE
from jaxmoe.layers.activations import SCOPE as ACTIVATION_SCOPE
from jaxmoe.layers.norms import SCOPE as NORM_SCOPE
from jaxmoe.layers.recompute import KEPT_PRIMITIVES
from jaxmoe.parallel.zero import GATHER_SCOPE
from jaxmoe.pipeline.microbatches import in_flight as in_flight_of
from jaxmoe.pipeline.ticks import tick_table
from jaxmoe.plan.memory import backward_start, recomputed_for_backward
from jaxmoe.plan.options import Options
from scheduling import SLICING, CostModel, Phase, Program, Value, aval_bytes

# Ops that pass a parameter on as a parameter: casts, views and the barriers of a
# recomputation's inputs.
_CARRIES_PARAMETERS = frozenset(
    {"convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
     "expand_dims", "copy", "copy_p", "reduce_precision", "pvary"}
)  # fmt: skip
# The parts of a step's ops that the bounds take away, with the per-op overheads of each.
_PARTS = (
    "step", "recomputing", "sharding", "update", "update_compute", "on_parameters",
    "overhead_step", "overhead_recomputing", "overhead_sharding", "overhead_update",
    "link", "link_recomputing", "link_sharding",
)  # fmt: skip
# A layer's ops: under its name scope ``layer_<i>``, or in a pipeline's chunk
# ``chunk_layer_<j>`` (jaxmoe.pipeline.pipelined; ZeRO-1's gathers of a stacked block too).
LAYER_SCOPE = re.compile(r"(^|/)(chunk_)?layer_\d+(/|$)")


def block_scope(first_dense_layers: int) -> re.Pattern[str]:
    """The scope of the repeating blocks' ops (:mod:`jaxmoe.plan.layer_extrapolation`):
    every layer's but the leading dense layers' (``model.first_dense_layers``), which
    stand with the embedding, outside the blocks (a model with them is not pipelined
    here: the planner bounds its pipelines by their own traces)."""
    if not first_dense_layers:
        return LAYER_SCOPE
    leading = "|".join(str(index) for index in range(first_dense_layers))
    return re.compile(rf"(^|/)(chunk_layer_\d+|layer_(?!(?:{leading})(?:/|$))\d+)(/|$)")


_RECOMPUTED = "rematted_computation"
_INPUT_KEPT = re.compile(rf"(^|/)({ACTIVATION_SCOPE}|{NORM_SCOPE})(/|$)")


@dataclass(frozen=True)
class Split:
    """A figure of the traced step: the part outside the blocks, and one block's part."""

    outside: float
    block: float

    def at(self, blocks: int) -> float:
        return self.outside + blocks * self.block

    @staticmethod
    def of(total: float, in_blocks: float, traced_blocks: int) -> Split:
        return Split(total - in_blocks, in_blocks / traced_blocks)


@dataclass(frozen=True)
class Screen:
    """The bounds one trace of a mapping gives (module docstring)."""

    options: Options  # the traced mapping's
    blocks: int  # the model's
    step: Split  # seconds of the ops the step runs (computation alone: compute_only)
    recomputing: Split  # seconds of the recomputations' ops
    sharding: Split  # seconds of the parameter gathers and of JAX's marks on kept values
    update: Split  # seconds of the rest of the update (gradient sync, optimizer)
    update_compute: Split  # of them, the optimizer's (no collectives)
    # Of the forward and backward ops, those on values of parameters' shapes alone
    # (casts, transposes): their work is the same whatever the rows, once per microbatch.
    on_parameters: Split
    # The per-op overheads of the forward and backward ops, of the recomputations' and of
    # the sharding's among them.
    overhead_step: Split
    overhead_recomputing: Split
    overhead_sharding: Split
    overhead_update: Split
    # Seconds of the collectives (the link's work), of the recomputations' and of the
    # parameter gathers among them: what the link runs whatever the schedule.
    link: Split
    link_recomputing: Split
    link_sharding: Split
    state: int  # bytes of the state at the model's depth
    saved: Split  # bytes of forward values alive when the backward pass begins
    # Of the parameters gathered by ZeRO (and their casts), the bytes alive then.
    gathered: Split
    # The most bytes the backward pass adds before its first block's (the head's).
    head_transient: int
    recomputed: Split  # bytes a recomputation makes again for the backward pass
    recomputed_core: Split  # of them, the core attention's
    # Of them, the results of weight matmuls and exchanges: what ``matmuls`` keeps.
    recomputed_matmuls: Split
    compute_only: bool
    link_bounds: bool = True  # with compute_only: the link's work bounds the step too

    def step_bound(self, options: Options) -> float:
        """A lower bound of the step time of the traced layout with ``options``."""
        if options.microbatches < self.options.microbatches:
            raise ValueError("a screen bounds variants in as many microbatches or more")
        seconds = self.step.at(self.blocks)
        overhead = self.overhead_step.at(self.blocks)
        if options.recompute != self.options.recompute:
            seconds -= self.recomputing.at(self.blocks)
            overhead -= self.overhead_recomputing.at(self.blocks)
        if options.zero < self.options.zero:
            seconds -= self.sharding.at(self.blocks)
            overhead -= self.overhead_sharding.at(self.blocks)
        extra = options.microbatches - self.options.microbatches
        seconds += extra * overhead / self.options.microbatches
        if self.compute_only and self.link_bounds:
            seconds = max(seconds, self.link_bound(options))
        return max(seconds, 0.0)

    def link_bound(self, options: Options) -> float:
        """A lower bound of the link's work in the traced layout with ``options``: its
        collectives, less those recomputed (other recomputation) and the parameter gathers
        (a lower ZeRO stage). Microbatches split the rows' collectives into as many of a
        share each, no less in all; schedules split or move collectives, never drop one."""
        seconds = self.link.at(self.blocks)
        if options.recompute != self.options.recompute:
            seconds -= self.link_recomputing.at(self.blocks)
        if options.zero < self.options.zero:
            seconds -= self.link_sharding.at(self.blocks)
        return max(seconds, 0.0)

    def pipeline_step_bound(self, options: Options, stages: int, virtual: int) -> float:
        """A lower bound of the step time of the traced stage layout (traced without a
        pipeline) as each stage of a pipeline of ``stages`` (``virtual`` chunks each) with
        ``options``. A stage's devices hold ``stages`` times the rows of the traced step's
        over ``1 / stages`` of its layers.

        The blocks: the devices run the schedule's ticks (``microbatches x virtual +
        stages - 1`` where the stages divide the microbatches), each the ops of one chunk
        (``1 / (stages x virtual)`` of the layers, the longest chunk's where they are
        uneven) on one microbatch, idle ticks on zeros; so the work of the traced step's
        blocks ``ticks / (microbatches x virtual)`` times, and their per-op overheads
        ``ticks / (stages x virtual)`` times, the ops on parameters alone ``(ticks - 1) /
        (stages x virtual)`` times (the first backward slot's gradient sums are with zeros,
        which XLA drops).
        Outside the blocks (the embedding, the head and the loss) every stage runs the
        traced step's ops once per microbatch on its rows: at least ``min(stages,
        microbatches)`` times their work (each op's work grows with the rows, or is the
        same per microbatch), and their overheads once per microbatch. ZeRO-1's gathers
        and the update are taken away, but for the optimizer's own ops where the traced
        step shards the optimizer: a stage's devices then hold shards as large (its
        blocks' parameters over ``1 / stages`` of the replicas, the rest over them all),
        and without ZeRO the whole of a stage's parameters, no fewer."""
        traced = self.options.microbatches
        block, outside = self._pass_parts(options.recompute)
        overheads, outside_fixed = self._pass_parts(options.recompute, overheads=True)
        padded = self._padded(stages, virtual)
        on_parameters = self.blocks * self.on_parameters.block * padded
        block, overheads = block * padded, overheads * padded
        block_fixed = overheads + on_parameters
        outside_fixed += self.on_parameters.outside
        ticks = tick_table(stages, virtual, options.microbatches).busy_forward_ticks
        return (
            max(block - block_fixed, 0.0) * ticks / (options.microbatches * virtual)
            + overheads / traced * ticks / (stages * virtual)
            + on_parameters / traced * (ticks - 1) / (stages * virtual)
            + max(outside - outside_fixed, 0.0) * min(stages, options.microbatches / traced)
            + outside_fixed / traced * options.microbatches
            + (
                self.update_compute.outside + self.update_compute.block * -(-self.blocks // stages)
                if self.options.zero
                else 0.0
            )
        )

    def _pass_parts(self, recompute: str, overheads: bool = False) -> tuple[float, float]:
        """The seconds of the traced step's forward and backward ops (or their per-op
        overheads) with ``recompute``, ZeRO's gathers and the update taken away: those of
        the model's blocks, and those outside them."""
        prefix = "overhead_" if overheads else ""
        total: Split = getattr(self, prefix + "step")
        taken: list[Split] = [] if overheads else [self.update]
        if recompute != self.options.recompute:
            taken.append(getattr(self, prefix + "recomputing"))
        if self.options.zero:
            taken.append(getattr(self, prefix + "sharding"))
        block = self.blocks * (total.block - sum(split.block for split in taken))
        outside = total.outside - sum(split.outside for split in taken)
        return max(block, 0.0), max(outside, 0.0)

    def keeps_at_least(self, options: Options) -> bool:
        """Whether ``options`` keep at least their share of what the traced options keep
        for the backward pass, parameters aside: no more recomputation, and as many
        microbatches or more (the walk runs the forward passes of the microbatches in
        flight first, each keeping its share of the rows' values). Any ZeRO stage: a plain
        or ZeRO-1 step keeps what differentiation needs, a fully sharded block more."""
        return RECOMPUTE.index(options.recompute) <= RECOMPUTE.index(self.options.recompute) and (
            options.microbatches >= self.options.microbatches
        )

    def memory_bound(self, options: Options, state: int) -> int:
        """A lower bound of the peak bytes of the traced layout with ``options``, whose
        state takes ``state`` bytes: the state, what the forward pass keeps, ZeRO-1's
        gathered parameters, and the head's backward pass on its share of the rows."""
        if not self.keeps_at_least(options):
            return state
        rows = self.options.microbatches / options.microbatches
        # The rows of the microbatches in flight, over the traced step's.
        in_flight = (
            rows * in_flight_of(options.microbatches) / in_flight_of(self.options.microbatches)
        )
        return int(
            state
            + self._kept(options) * in_flight
            + self._gathered(options, 1)
            + self.head_transient * rows
        )

    def _kept(self, options: Options, padded: float = 1.0) -> float:
        """Bytes of what the forward pass keeps for the backward pass with ``options``
        (its blocks' ``padded`` times)."""
        block = self.saved.block
        if options.recompute != self.options.recompute:
            # What the traced step recomputes in its blocks, kept instead.
            kept = self.recomputed.block
            if options.recompute == "attention":
                kept -= self.recomputed_core.block
            elif options.recompute == "matmuls":
                kept = self.recomputed_matmuls.block
            block += max(kept, 0.0)
        return self.saved.outside + self.blocks * padded * block

    def _padded(self, stages: int, virtual: int) -> float:
        """The blocks a pipeline's stages run, over the model's: every chunk runs as many
        positions as the longest (uneven chunks are padded)."""
        chunks = stages * virtual
        return -(-self.blocks // chunks) * chunks / self.blocks

    def _gathered(self, options: Options, stages: int, padded: float = 1.0) -> float:
        """ZeRO-1's parameters, gathered once and held from the forward pass to the
        backward pass (of ``1 / stages`` of the blocks, ``padded`` times): where the traced
        step gathers them too."""
        if options.zero != 1 or self.options.zero != 1:
            return 0.0
        return self.gathered.outside + self.blocks * padded * self.gathered.block / stages

    def pipeline_memory_bound(self, options: Options, state: int, stages: int, virtual: int) -> int:
        """A lower bound of the peak bytes of a pipeline of ``stages`` stages (``virtual``
        chunks each), each laid out as the traced step, with ``options``, whose state
        takes ``state`` bytes.

        A stage's devices hold ``stages`` times the rows over ``1 / stages`` of the
        layers, so one microbatch's residuals in one chunk are ``1 / (microbatches x
        virtual)`` of what the traced step keeps for the backward pass. The walk follows
        the ticks, and a tick's forward slot keeps one such set on every device (one SPMD
        program: an idle stage's on zeros) until the last backward slot that reads it.
        Before each backward slot, every forward slot that it or a later one reads is
        alive: at most :attr:`~jaxmoe.pipeline.ticks.TickTable.residuals_held` of them
        (``2 stages - 1`` in 1F1B, where stage 0 reads its forward slot's residuals
        ``2 (stages - 1)`` ticks later), each chunk as long as the longest (uneven chunks
        are padded).
        ZeRO-1's gathered parameters are the stage's; every stage runs the
        head's backward pass on its microbatch's rows (``stages`` times the traced rows
        over the microbatches, no more than the traced step's counted)."""
        if not self.keeps_at_least(options):
            return state
        held = tick_table(stages, virtual, options.microbatches).residuals_held
        rows = min(1.0, stages * self.options.microbatches / options.microbatches)
        padded = self._padded(stages, virtual)
        return int(
            state
            + self._kept(options, padded) * held / (options.microbatches * virtual)
            + self._gathered(options, stages, padded)
            + self.head_transient * rows
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Screen:
        kept = ("saved", "gathered", "recomputed", "recomputed_core", "recomputed_matmuls")
        names = (*_PARTS, *kept)
        splits = {name: Split(**data[name]) for name in names}
        return Screen(
            **{**data, **splits, "options": Options(**data["options"])}  # type: ignore[arg-type]
        )


def screen(
    program: Program,
    state: Any,
    cost: CostModel,
    options: Options,
    blocks: int,
    traced_blocks: int,
    state_bytes: int,
    compute_only: bool,
    link_bounds: bool = True,
    first_dense_layers: int = 0,
) -> Screen:
    """The bounds of the traced step ``program`` (``traced_blocks`` of the model's
    ``blocks`` after its ``first_dense_layers``; its first argument has the structure of
    ``state``), priced by ``cost``."""
    blocks_scope = block_scope(first_dense_layers)
    totals = {name: [0.0, 0.0] for name in _PARTS}
    profile = cost.profile
    parameters = _parameters(program)
    weights = _parameters(program, program.inputs[: len(jax.tree.leaves(state))])
    shapes = {value.aval.shape for value in weights if value.aval.ndim}
    update_in_blocks = _update_in_blocks(program, blocks_scope, state)
    for op in program.ops:
        in_block = bool(blocks_scope.search(op.layer)) or op.index in update_in_blocks
        collective = op.is_collective or op.primitive == "ragged_all_to_all"
        priced = cost.seconds(op)
        seconds = 0.0 if compute_only and collective else priced
        parts = ["step"]
        if _RECOMPUTED in op.name_stack:
            parts.append("recomputing")
        if op.primitive == "all_gather" and GATHER_SCOPE in op.layer:
            parts.append("sharding")
        elif op.phase is Phase.OPTIMIZER:
            parts.append("update")
            if not collective:
                parts.append("update_compute")
        elif len(parts) == 1 and not collective and _on_parameters(op, shapes):
            parts.append("on_parameters")
        # A slice launches where its reader cannot take it fused, which another layout's
        # step (a pipeline's ticks) may: its launch is not counted.
        pays_overhead = (
            op.phase is not Phase.OPTIMIZER
            and not collective
            and op.primitive not in SLICING
            and cost.launches(op)
        )
        if collective:
            linked = ("link" if part == "step" else f"link_{part}" for part in parts)
            parts += [part for part in linked if part in totals]
        for part in parts:
            if part.startswith("link"):
                totals[part][0] += priced
                totals[part][1] += priced if in_block else 0.0
                continue
            totals[part][0] += seconds
            totals[part][1] += seconds if in_block else 0.0
            overhead = f"overhead_{part}"
            if pays_overhead and overhead in totals:
                totals[overhead][0] += profile.op_overhead_s
                totals[overhead][1] += profile.op_overhead_s if in_block else 0.0
    # Parameters gathered or cast are the state's where the variant holds them whole.
    start = backward_start(program, state, blocks_scope)
    saved_total, saved_blocks = start.bytes(leaving_out=parameters)
    gathers = _parameters(program, _gathered(program))
    with_gathers = start.bytes(leaving_out=parameters - gathers)
    splits = {
        name: Split.of(total, in_blocks, traced_blocks)
        for name, (total, in_blocks) in totals.items()
    }
    # A recomputation's parameters (a block's gathers, their casts) are the state's, or
    # gathered again, where nothing is recomputed: not activations it keeps. Nor are an
    # activation's or a norm's values: a block whose forward values are kept keeps their
    # inputs alone (jaxmoe.layers.input_kept), made by the ops before them.
    recomputed = {
        value: op
        for value, op in recomputed_for_backward(program, state).items()
        if value not in parameters and not _INPUT_KEPT.search(op.layer)
    }
    core = _core_attention(program, parameters)
    in_blocks = {v: op for v, op in recomputed.items() if blocks_scope.search(op.layer)}
    matmuls = {v: op for v, op in in_blocks.items() if _kept_by_matmuls(op, parameters)}
    return Screen(
        options=options,
        blocks=blocks,
        state=state_bytes,
        saved=Split.of(saved_total, saved_blocks, traced_blocks),
        gathered=Split.of(
            with_gathers[0] - saved_total, with_gathers[1] - saved_blocks, traced_blocks
        ),
        head_transient=start.transient,
        recomputed=Split.of(_bytes(recomputed), _bytes(in_blocks), traced_blocks),
        recomputed_core=Split.of(
            _bytes({v: op for v, op in in_blocks.items() if v in core}),
            _bytes({v: op for v, op in in_blocks.items() if v in core}),
            traced_blocks,
        ),
        recomputed_matmuls=Split.of(_bytes(matmuls), _bytes(matmuls), traced_blocks),
        compute_only=compute_only,
        link_bounds=link_bounds,
        **splits,
    )


# Ops that put several values into one: at a greater depth one such op may take every
# block's values, so they are not counted once per block.
_PACKS = frozenset({"concatenate", "pad", "dynamic_update_slice", "scatter", "scatter-add"})


def _update_in_blocks(program: Program, blocks_scope: re.Pattern[str], state: Any) -> set[int]:
    """The update's ops (the gradients' sums, clipping, the optimizer) that each block
    repeats for its own parameters: outside the blocks' scope, they are found by what they
    read. A value made in a block's scope is the block's, and so is the state of a block's
    parameters (``state``: the structure of the program's first arguments; its blocks'
    leaves under ``blocks``) and a value made from the block's values alone (a moment's
    decay, which JAX traces with the forward pass); one made elsewhere in the forward or
    backward pass is not (the embedding's and the head's gradients), nor is the state of
    other parameters; any other value is of what it is made from. An update op counts once
    per block when what it reads is the block's, values of both kinds aside (a global
    norm's running sum, what it scales by, gradients a collective packed together): a
    per-parameter square, sum, moment or step. Collectives and ops that pack values
    together are left outside the blocks (at a greater depth one may serve every block),
    so the blocks' share stays a lower bound of what each further block adds."""
    block, other = 1, 2
    kind: dict[Value, int] = {}
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, _), value in zip(leaves, program.inputs, strict=False):
        layer = _block_of(path)
        if layer is not None:
            kind[value] = block if blocks_scope.search(f"layer_{layer}") else other
    found: set[int] = set()
    for op in program.ops:
        if op.phase is not Phase.OPTIMIZER:
            mark = block if blocks_scope.search(op.layer) or _reads_only(op, kind, block) else other
        else:
            read = [kind.get(a, 0) for a in op.inputs if isinstance(a, Value)]
            mark = functools.reduce(operator.or_, read, 0)
            pure = functools.reduce(operator.or_, (k for k in read if k != block | other), 0)
            collective = op.is_collective or op.primitive == "ragged_all_to_all"
            if pure == block and not collective and op.primitive not in _PACKS:
                found.add(op.index)
        for value in op.outputs:
            kind[value] = mark
    return found


def _reads_only(op: Any, kind: dict[Value, int], wanted: int) -> bool:
    """Whether every value ``op`` reads (one at least) is of kind ``wanted``."""
    read = {kind.get(a, 0) for a in op.inputs if isinstance(a, Value)}
    return read == {wanted}


def _block_of(path: Sequence[Any]) -> int | None:
    """The layer whose block a state leaf at ``path`` belongs to (``blocks`` then its
    index), or None."""
    keys = [getattr(key, "key", getattr(key, "idx", None)) for key in path]
    for name, index in itertools.pairwise(keys):
        if name == "blocks" and isinstance(index, int):
            return index
    return None


def _bytes(values: dict[Value, Any]) -> float:
    return float(sum(aval_bytes(value.aval) for value in values))


def _on_parameters(op: Any, shapes: set[tuple[int, ...]]) -> bool:
    """Whether ``op`` reads and makes values of parameters' shapes alone (a parameter's
    cast or transpose, a weight gradient's cast or sum): no rows in them."""
    read = [a for a in op.inputs if isinstance(a, Value)]
    return bool(read) and all(v.aval.shape in shapes for v in (*read, *op.outputs))


def _gathered(program: Program) -> list[Value]:
    """The parameters ZeRO's gathers make."""
    return [
        value
        for op in program.ops
        if op.primitive == "all_gather" and GATHER_SCOPE in op.layer
        for value in op.outputs
    ]


def _parameters(program: Program, inputs: Sequence[Value] | None = None) -> set[Value]:
    """The program's ``inputs`` (default: all, the state and the batch) and the values
    that carry them on unchanged but for their dtype, layout or gathering: no layer's
    activations."""
    parameters = set(program.inputs if inputs is None else inputs)
    for op in program.ops:
        if op.primitive == "optimization_barrier":  # each operand passes through alone
            pairs = zip(op.inputs, op.outputs, strict=True)
            parameters.update(v for a, v in pairs if a in parameters)
            continue
        carries = op.primitive in _CARRIES_PARAMETERS or (
            op.primitive == "all_gather" and GATHER_SCOPE in op.layer
        )
        if carries and all(a in parameters for a in op.inputs if isinstance(a, Value)):
            parameters.update(op.outputs)
    return parameters


def _kept_by_matmuls(op: Any, parameters: set[Value]) -> bool:
    """Whether ``matmuls`` keeps what ``op`` makes: a matmul of a weight or an exchange
    (:data:`jaxmoe.layers.recompute.KEPT_PRIMITIVES`). An FP8 product's matmuls, the flash
    cores' residuals and the dense core's scores are left out: a lower bound may keep
    less."""
    if op.primitive not in KEPT_PRIMITIVES:
        return False
    if op.primitive in ("dot_general", "ragged_dot_general"):
        return any(a in parameters for a in op.inputs if isinstance(a, Value))
    return True


def _core_attention(program: Program, parameters: set[Value]) -> set[Value]:
    """The values of the core attention that recomputations make: in an attention scope,
    from the matmul of two activations (queries and keys) up to the next such matmul
    (with the values), that one's result aside."""
    core: set[Value] = set()
    recomputing = [
        op for op in program.ops if _RECOMPUTED in op.name_stack and "attention" in op.layer
    ]
    by_layer: dict[str, list[Any]] = {}
    for op in recomputing:
        found = LAYER_SCOPE.search(op.layer)
        by_layer.setdefault(found.group(0) if found else "", []).append(op)
    for ops in by_layer.values():
        matmuls = [
            op
            for op in ops
            if op.primitive == "dot_general"
            and not any(a in parameters for a in op.inputs if isinstance(a, Value))
        ]
        if len(matmuls) < 2:
            continue
        first, last = matmuls[0], matmuls[1]
        after = set(first.outputs)
        for op in ops:
            if op is not first and any(a in after for a in op.inputs if isinstance(a, Value)):
                after.update(op.outputs)
        before: set[Value] = {a for a in last.inputs if isinstance(a, Value)}
        for op in reversed(ops):
            if any(v in before for v in op.outputs):
                before.update(a for a in op.inputs if isinstance(a, Value))
        core |= (after & before) - set(last.outputs)
    return core
