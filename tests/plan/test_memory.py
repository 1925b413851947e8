"""The step's memory model (jaxmoe/plan/memory.py) against XLA:CPU's compiled memory
analysis, on 8 fake devices, over the options that change it.

XLA's peak is its arguments, its outputs that do not alias a donated argument, and its
temporaries. The walk must come within 10% of it, and its state and batch must equal XLA's
arguments to the byte. XLA:CPU keeps the barriers in front of a recomputation until it has
scheduled the step, as XLA:GPU does (from jax 0.11.2; docs/xla_notes.md), so the walk that
keeps them (``keeps_barriers=True``) is the one compared, and a recomputation saves memory
on CPU too, no more than what it makes again; walked with the barriers dropped before CSE
(``keeps_barriers=False``, XLA:CPU up to jax 0.10.2) it saves nothing. A pipeline's walk
follows its ticks (1F1B over 2 stages and 4 microbatches, with and without the distributed
optimizer); walking every tick's forward slot first instead would hold 1.55 times XLA's
peak.

One compiled step per case, shared by the tests of the module (eight compilations).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.plan.memory import (
    _RECOMPUTED,
    StepMemory,
    _Walk,
    _walk_steps,
    backward_start,
    step_memory,
)
from jaxmoe.plan.state_memory import memory_per_device
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step
from scheduling import aval_bytes, capture
from scheduling.names import MICROBATCHES_IN_FLIGHT, TICK_SCOPE
from tests.scheduling.toys import mesh_x, sds

TICK = re.compile(TICK_SCOPE.format(r"\d+"))
# XLA:CPU's peak against the walk's: the walk fuses a few values XLA keeps, and XLA's heap
# leaves gaps between buffers (see the module docstring of jaxmoe/plan/memory.py).
TOLERANCE = 0.10

EXPERT4 = ParallelConfig(data=2, expert=4)
PIPELINE = dict(
    microbatches=4, layers=4, batch=32, parallel=ParallelConfig(data=2, expert=2, pipeline=2)
)
CASES = {
    "plain": dict(attention="blockwise"),  # the flash core in one tile; the others dense
    "zero1-tensor2": dict(zero=1, parallel=ParallelConfig(data=2, expert=4, tensor=2)),
    "zero3-expert_tensor2-microbatches2": dict(
        zero=3, microbatches=2, parallel=ParallelConfig(data=2, expert=2, expert_tensor=2)
    ),
    "recompute-attention-microbatches2": dict(recompute="attention", microbatches=2),
    "recompute-attention-microbatches6": dict(recompute="attention", microbatches=6, batch=48),
    "recompute-layer-microbatches2": dict(recompute="layer", microbatches=2),
    "pipeline": PIPELINE,
    "pipeline-zero1": dict(PIPELINE, zero=1),
    "pipeline-interleaved": dict(
        PIPELINE, layers=8, parallel=ParallelConfig(data=2, expert=2, pipeline=2, virtual_stages=2)
    ),
}
# XLA:CPU holds more than the walk of these: it runs forward slots ticks early (below).
RUNS_AHEAD = ("pipeline-zero1", "pipeline-interleaved")
# XLA:CPU holds more than the walk of six microbatches (a test of its own below).
WAITING = "recompute-attention-microbatches6"
# Interleaved stages are slow to compile, and ZeRO-1 on a pipeline is another option set
# for what the plain pipeline checks by default.
SLOW_CASES = {"pipeline-interleaved", "pipeline-zero1"}


def cases(names) -> list:
    return [
        pytest.param(name, marks=pytest.mark.slow if name in SLOW_CASES else ()) for name in names
    ]


def config_for(
    attention: str = "dense",
    zero: int = 0,
    microbatches: int = 1,
    recompute: str = "none",
    parallel: ParallelConfig = EXPERT4,
    layers: int = 2,
    batch: int = 16,
) -> Config:
    return Config(
        model=ModelConfig(
            d_model=64, num_heads=4, num_layers=layers, d_ff=256, seq_len=64, moe_every=2,
            recompute=recompute, attention=attention,
        ),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        parallel=parallel,
        train=TrainConfig(batch_size=batch, warmup_steps=1, zero=zero, microbatches=microbatches),
    )  # fmt: skip


@functools.cache
def measured(case: str):
    """XLA:CPU's memory analysis of the compiled step, the captured program, and the walk
    with the barriers kept (as XLA:CPU and XLA:GPU compile it) and dropped before CSE."""
    config = config_for(**CASES[case])
    mesh = build_mesh(config.parallel)
    analysis = scheduled_train_step(resolve(config, mesh)).compile().memory_analysis()
    program, _ = capture_train_step(resolve(config, mesh))
    state = resolve(config).state_shapes
    walk = step_memory(program, state, keeps_barriers=True)
    merged = step_memory(program, state, keeps_barriers=False)
    return config, analysis, program, walk, merged


def xla_peak(analysis) -> int:
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


@pytest.mark.parametrize("case", cases(c for c in CASES if c not in (*RUNS_AHEAD, WAITING)))
def test_the_walk_comes_within_ten_percent_of_xla_cpu(case):
    _, analysis, _, walk, _ = measured(case)
    assert walk.total == pytest.approx(xla_peak(analysis), rel=TOLERANCE)
    # The state and the batch are XLA's arguments, to the byte.
    assert walk.master + walk.optimizer + walk.batch == analysis.argument_size_in_bytes


@pytest.mark.parametrize("case", cases(["pipeline", *RUNS_AHEAD]))
def test_xla_cpu_runs_a_pipelines_forward_slots_at_most_a_chunk_early(case):
    """Nothing makes a tick's forward slot wait for the previous tick's backward slot:
    XLA:CPU holds more than the tick order (jax 0.12.0.1: 1% more on 1F1B, with ZeRO-1 8%,
    interleaved 8%) and less than every forward slot as many ticks early as a stage has
    chunks (12 to 18% more than XLA:CPU)."""
    config, analysis, program, walk, _ = measured(case)
    virtual = config.parallel.virtual_stages
    state = resolve(config).state_shapes
    ahead = step_memory(program, state, ticks_ahead=virtual)
    assert walk.total <= xla_peak(analysis) <= ahead.total
    assert ahead.total < 1.2 * xla_peak(analysis)


@pytest.mark.parametrize("case", cases(["pipeline", "pipeline-zero1"]))
def test_a_pipeline_holds_what_its_stages_hand_on(case):
    _, _, _, walk, _ = measured(case)
    assert walk.pipeline > 0  # the activations and gradients the stages hand on


@pytest.mark.parametrize("case", cases(CASES))
def test_the_state_at_the_peak_is_the_state_model(case):
    config, _, _, walk, merged = measured(case)
    state = memory_per_device(config)  # a pipeline's: one stage's blocks
    for walked in (walk, merged):
        assert walked.master == state.parameters
        assert walked.optimizer == state.optimizer


def test_the_peak_by_kind():
    _, _, _, plain, _ = measured("plain")
    # float32: the matmuls read the state's parameters, no copies.
    assert plain.parameters == 0 and plain.pipeline == 0
    assert plain.activations > plain.backward > 0
    assert plain.microbatches_in_flight == 1
    _, _, _, zero1, _ = measured("zero1-tensor2")
    # ZeRO-1 gathers every parameter at the start of the step; at the peak (in the
    # backward pass) those of the layers already differentiated are released.
    gathered = memory_per_device(config_for(**CASES["zero1-tensor2"])).gathered
    assert 0 < zero1.parameters <= gathered


@functools.cache
def walked(**fields) -> tuple[StepMemory, StepMemory]:
    """The walk of a configuration that is captured but not compiled, with the barriers
    kept and dropped before CSE."""
    config = config_for(**fields)
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel)))
    state = resolve(config).state_shapes
    return (
        step_memory(program, state, keeps_barriers=True),
        step_memory(program, state, keeps_barriers=False),
    )


def test_a_microbatch_waits_for_the_backward_pass_three_before_it():
    """Nothing in the gradients orders a microbatch's backward pass before a later one's
    forward pass: of two microbatches both forward passes run first (XLA:CPU within 10%
    of the walk), about what one batch of their rows holds. From the fourth on, each waits
    for the backward pass of the one three before (MICROBATCHES_IN_FLIGHT): of six, three
    are in flight, half of what the batch holds. XLA:CPU holds more than the walk there
    (24% with jax 0.12.0.1, the state included) but, the state aside, under three quarters
    of the walk of the batch in one."""
    assert MICROBATCHES_IN_FLIGHT == 3
    _, _, _, two, _ = measured("recompute-attention-microbatches2")
    assert two.microbatches_in_flight == 2
    one_batch, _ = walked(recompute="attention")
    # At the peak (where the forward values and the backward pass's buffers together are
    # the most: the split between the two moves with the peak).
    assert two.activations + two.backward == pytest.approx(
        one_batch.activations + one_batch.backward, rel=0.15
    )
    _, analysis, _, six, _ = measured(WAITING)
    # Three forward passes ahead; the peak may fall inside a backward pass, whose
    # microbatch's values are still partly alive beside them.
    assert six.microbatches_in_flight in (3, 4)
    whole, _ = walked(recompute="attention", batch=48)
    # When the first backward pass begins, three forward passes' values are alive: half of
    # what the batch in one keeps then.
    assert _kept_when_the_backward_begins(**CASES[WAITING]) == pytest.approx(
        _kept_when_the_backward_begins(recompute="attention", batch=48) / 2, rel=0.15
    )
    assert six.total <= xla_peak(analysis) <= 1.3 * six.total
    state = whole.master + whole.optimizer + whole.batch
    assert xla_peak(analysis) - state < 0.75 * (whole.total - state)


def _kept_when_the_backward_begins(**fields) -> int:
    """The bytes of forward values alive at the first op of the backward pass."""
    config = config_for(**fields)
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel)))
    kept, _ = backward_start(program, resolve(config).state_shapes, re.compile("")).bytes()
    return kept


def _recomputed_bytes(program) -> int:
    """The bytes a step's recomputations make again."""
    return sum(
        aval_bytes(value.aval)
        for op in program.ops
        if "rematted_computation" in op.name_stack
        for value in op.outputs
    )


def test_full_recomputation_keeps_each_block_input_alone():
    _, _, program, walk, merged = measured("recompute-layer-microbatches2")
    kept, kept_merged = walked(microbatches=2)
    # Behind its barrier each block's forward pass runs again in its backward pass (XLA:CPU
    # within 10% of the walk): the activations are less than half of what is kept without.
    assert 0 < kept.activations - walk.activations <= _recomputed_bytes(program)
    assert walk.activations < kept.activations / 2
    # Dropped before CSE, the barriers let the recomputation merge with the forward values
    # (and the activations' own recomputation with theirs, in both steps).
    assert merged.activations == kept_merged.activations


def test_recomputation_saves_only_where_the_barriers_are_kept():
    _, _, program, walk, merged = measured("recompute-attention-microbatches2")
    kept, kept_merged = walked(microbatches=2)
    # Kept (XLA:CPU within 10% of the walk), the barriers keep the recomputation apart from
    # the forward values it repeats; dropped before CSE, the walk holds what it holds
    # without recomputation, with the barriers dropped there too.
    saved = kept.activations - walk.activations
    assert 0 < saved <= _recomputed_bytes(program)
    assert merged.activations == kept_merged.activations


def test_fully_sharded_blocks_release_their_gathers_where_the_barriers_are_kept():
    _, _, _, walk, merged = measured("zero3-expert_tensor2-microbatches2")
    config = config_for(**CASES["zero3-expert_tensor2-microbatches2"])
    # Kept (XLA:CPU within 10% of the walk): the blocks outside plus one block gathered.
    # Dropped before CSE, each block's second gather merges with its first, and every
    # block's is kept.
    assert walk.parameters <= memory_per_device(config).gathered < merged.parameters


def test_json_names_every_kind():
    _, _, _, walk, _ = measured("plain")
    data = walk.to_json()
    assert data["total"] == walk.total == sum(
        data[kind]
        for kind in (
            "master", "optimizer", "batch", "parameters", "activations", "backward", "pipeline"
        )
    )  # fmt: skip
    assert isinstance(walk, StepMemory)


def test_repeated_ops_merge_except_behind_a_kept_barrier():
    """XLA's CSE merges an op that repeats an earlier one whether it keeps the barriers or
    not; behind a kept barrier the recomputation is new, and stays."""

    def step(w, x):
        h = x @ w  # the loss below repeats this product: one buffer
        recomputed = jax.checkpoint(jnp.tanh, prevent_cse=True)
        grad = jax.grad(lambda w: jnp.sum(recomputed(x @ w)))(w)
        return jnp.sum(h) + jnp.sum(grad)

    mesh = mesh_x()
    program = capture(
        step,
        sds(mesh, (8, 16), P()),
        sds(mesh, (8 * 4, 8), P("x")),
        mesh=mesh,
        in_specs=(P(), P("x")),
        out_specs=P(),
    )

    def made(steps, primitive, recomputed):
        return [
            step
            for step in steps
            if step.op.primitive == primitive
            and (_RECOMPUTED in step.op.name_stack) == recomputed
            and step.makes
        ]

    for keeps_barriers in (True, False):
        steps, _ = _walk_steps(program, keeps_barriers)
        assert len(made(steps, "tanh", recomputed=False)) == 1
        assert len(made(steps, "dot_general", recomputed=False)) == 2  # x @ w; x^T g
        assert len(made(steps, "tanh", recomputed=True)) == int(keeps_barriers)


def test_an_update_in_place_and_a_running_sum_hold_one_buffer():
    """A stack updated row by row and a sum of matmuls kept behind a barrier each step (a
    pipeline's gradients over its ticks) hold one buffer each: XLA writes the result of
    ``dynamic_update_slice`` into its operand's buffer, and an elementwise op's into an
    operand of its type, where nothing reads the operand after them."""
    rows, width = 8, 128

    def step(w, x):
        stack = jnp.zeros((rows, width, width))
        total = jnp.zeros((width, width))
        for i in range(rows):
            product = x[i] @ w
            stack = jax.lax.dynamic_update_index_in_dim(stack, product, i, axis=0)
            total = jax.lax.optimization_barrier(total + product)
        return jnp.sum(stack) + jnp.sum(total)

    mesh = mesh_x()
    program = capture(
        step,
        sds(mesh, (width, width), P()),
        sds(mesh, (rows, width, width), P()),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=P(),
    )
    walk = _Walk(program, ((program.inputs[0],),), keeps_barriers=True)
    peak = max(size for _, _, size in walk.run())
    square = width * width * 4
    inputs = square + rows * square
    # The inputs, one stack, and a few squares (the sum, the product being added, the zeros
    # the sum starts from); counting the operand beside each result would be another stack.
    assert peak < inputs + (rows + 4) * square


def test_a_sum_with_zeros_is_its_other_operand():
    """The gradient of an input a function does not read is zeros; added to a running sum,
    XLA takes the sum for its other operand (``scheduling.sum_with_zeros``): the sum makes
    no buffer, and what reads it reads that operand."""

    def step(total, x):
        grads = jax.grad(lambda p: jnp.sum(p["used"] ** 2))({"used": x, "unused": x})
        return jax.lax.optimization_barrier(total + grads["unused"])

    mesh = mesh_x()
    program = capture(
        step,
        sds(mesh, (8, 16), P()),
        sds(mesh, (8, 16), P()),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=P(),
    )
    steps, _ = _walk_steps(program, keeps_barriers=True)
    (added,) = [s for s in steps if s.op.primitive == "add"]
    assert not added.makes and not added.reads
    (barrier,) = [s for s in steps if s.op.primitive == "optimization_barrier"]
    assert barrier.reads == (program.inputs[0],)


def test_a_pipeline_sums_each_slots_gradients_as_it_goes():
    """The gradients of the parameters outside the blocks are summed slot by slot, each sum
    a buffer of its own: at equal rows per microbatch, twice the microbatches hold no more
    of the backward pass's values (one chain of fused adds held every microbatch's head
    and embedding gradients until the last tick)."""
    _, _, _, four, _ = measured("pipeline")  # 4 microbatches of 4 rows a device
    eight, _ = walked(**dict(PIPELINE, microbatches=8, batch=64))
    assert eight.backward == four.backward


def test_interleaved_slots_slice_their_chunks_parameters_anew():
    """Every slot of an interleaved pipeline slices its chunk's parameters from the stack
    behind a barrier with its input: no two slots' slices are one value to CSE, which
    would hold a copy of a chunk's parameters from its first slot to its last."""
    config = config_for(**CASES["pipeline-interleaved"])
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel)))
    # The state and what the step makes of it alone before the first tick: the stacks.
    of_state = set(program.inputs)
    for op in program.ops:
        read = [a for a in op.inputs if hasattr(a, "aval") and not hasattr(a, "value")]
        if not TICK.search(op.layer) and read and all(a in of_state for a in read):
            of_state.update(op.outputs)
    steps, _ = _walk_steps(program, keeps_barriers=True)
    slices = [
        step
        for step in steps
        if TICK.search(step.op.layer)
        and step.op.primitive in ("slice", "dynamic_slice")
        and step.op.inputs[0] in of_state
        and step.op.inputs[0].aval.shape[0] == config.parallel.virtual_stages
        and jnp.issubdtype(step.op.inputs[0].aval.dtype, jnp.floating)  # not the rows
    ]
    assert slices and all(step.makes for step in slices)


def test_a_one_chunk_stage_sums_its_gradients_elementwise():
    """Each tick adds a one-chunk stage's block gradients to their sums elementwise, with
    the cast to the sums' dtype fused in: no scatter (which reads the cast gradients as
    buffers of their own) updates a stack of a stage's blocks."""
    _, _, program, _, _ = measured("pipeline")
    # A stage's stacked blocks [chunks, stage, ...] and their sums [chunks, ...].
    stacks = {v.aval.shape[:1] + v.aval.shape[2:] for v in program.inputs if v.aval.ndim > 2}
    scattered = [
        op
        for op in program.ops
        if op.primitive.startswith("scatter") and op.inputs[0].aval.shape in stacks
    ]
    assert stacks and not scattered
