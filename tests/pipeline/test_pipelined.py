"""Pipeline parallelism (``parallel.pipeline``) trains as the microbatch loop does.

A pipelined run on 2 stages of 4 devices is compared with the unpipelined run of the same
configuration on one stage's 4 devices (the same rows per device, the same microbatches,
the same router noise), over 3 steps of 2 microbatches: 1F1B on the unfolded layout
(chunks of a dense and an MoE block), the interleaved schedule (2 virtual stages)
on a folded layout (tensor, expert and expert-tensor parallelism over the same devices)
with full-layer recomputation, 1F1B on uneven chunks (1 and 2 MoE layers: the first
stage's second position is padding), and 1F1B and the interleaved schedule with the
distributed optimizer (ZeRO-1: on the unfolded layout the blocks sharded over the expert
axis within a stage, the rest over the pipeline axis too) against the unpipelined run
without it. By default the uneven chunks run with ZeRO-1 (1F1B on the unfolded layout,
one case for all three), and the interleaved schedule.

Tolerances. The same tokens drop (``dropped_fraction`` and ``tokens_per_expert`` equal
exactly). The pipeline computes each block as the loop does, but its chunks are separate
VJPs and its sums run in another order (a chunk's router losses, the head's and the
embedding's gradients), so XLA fuses and rounds differently, and differently from one
compilation to another. Measured on 2 microbatches, at most: losses 3.8e-7 relative
(tolerance 5e-6), the gradient norm 1.0e-6 (2e-5), Adam's first moment after one step,
(1 - b1) x the clipped gradient, 4.7e-9 absolute (3e-8 plus 1e-4 relative). After 5
AdamW steps of learning rate 1e-2, 99.9% of the parameters agree within 2.1e-6 (lr / 200)
and all within 5.9e-5 (lr / 10). (On 4 microbatches, over several runs: 1.2e-6, 6.8e-6,
6e-9, 8e-6 and 2.6e-4.) Adam moves a parameter whose gradient nearly cancels by up to
lr whatever the gradient's size, so the rounding of a tiny gradient can move it by far
more than the rest. A wrong stage order, a missing microbatch, a gradient not summed
over the pipeline axis or reduce-scattered over the wrong axes changes the first loss or
the first gradients by far more. The
scheduler's schedules (``dw``, ``async``, ``pair``) change nothing computed: bit for bit.
"""

import dataclasses
import functools

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import scheduling
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import (
    Config,
    ConfigError,
    DataConfig,
    DataSource,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.pipeline.params import PIPELINE_AXIS, stage_layout, to_layout
from jaxmoe.pipeline.pipelined import SELECT_SCOPE
from jaxmoe.pipeline.ticks import TickTable
from jaxmoe.train.resolved import resolve, schedule_policy
from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step
from jaxmoe.train.state import abstract_sharded_state, init_train_state, param_trees_mapped
from scheduling.passes import split_async
from scheduling.passes.pair_microbatches import pair_passes, tick_of
from scheduling.program.graph import Role
from scheduling.search.step_estimate import node_seconds
from tests.train.batches import random_batch
from tests.train.runs import linked

STEPS = 3
MICROBATCHES = 2  # the fewest with which 2 stages run a forward and a backward slot in one tick
LR = 1e-2
# One stage's devices, the model and the routing on them: on the unfolded layout a spare
# slot per device for a replica of a busy expert and the expert biases of
# auxiliary-loss-free balancing, on the folded one router noise.
LAYOUTS = {
    "plain": (
        ParallelConfig(data=1, expert=4),
        dict(moe_every=2),
        dict(slots_per_device=3, expert_bias_rate=1e-3),
    ),
    "folded": (
        ParallelConfig(data=1, expert=2, expert_tensor=2, tensor=2),
        dict(moe_every=1),
        dict(jitter=0.1),
    ),
}
# 3 layers in chunks of 1 and 2: the first stage's second position is padding.
UNEVEN = dict(num_layers=3, moe_every=1, chunk_layers="1,2")
# (layout, virtual stages, model.recompute, model fields, chunks and ZeRO stage) of each
# pipelined run; its unpipelined run has no ZeRO.
CASES = {
    "1f1b": ("plain", 1, "none", {}),
    "interleaved": ("folded", 2, "layer", {}),
    "uneven": ("plain", 1, "none", UNEVEN),
    "zero1": ("plain", 1, "none", dict(zero=1)),
    "uneven-zero1": ("plain", 1, "none", dict(UNEVEN, zero=1)),
    "interleaved-zero1": ("folded", 2, "layer", dict(zero=1)),
}
DEFAULT_CASES = ("interleaved", "uneven-zero1")


def config(
    layout: str,
    pipeline: int = 1,
    virtual: int = 1,
    recompute: str = "none",
    schedule: str = "none",
    microbatches: int = MICROBATCHES,
    chunk_layers: str | None = None,
    zero: int = 0,
    **model_fields,
) -> Config:
    parallel, model, routing = LAYOUTS[layout]
    model = {"num_layers": 4, **model, **model_fields}
    return Config(
        model=ModelConfig(d_model=32, num_heads=2, d_ff=64, seq_len=16, recompute=recompute,
                          **model),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0, **routing),
        parallel=dataclasses.replace(parallel, pipeline=pipeline, virtual_stages=virtual,
                                     chunk_layers=chunk_layers),
        train=TrainConfig(batch_size=16, warmup_steps=1, learning_rate=LR,
                          microbatches=microbatches, zero=zero),
        schedule=ScheduleConfig(name=schedule),
    )  # fmt: skip


def devices(config: Config) -> list:
    return jax.devices()[: config.parallel.num_devices]


@functools.cache
def compiled(config: Config):
    mesh = build_mesh(config.parallel, devices(config))
    return mesh, scheduled_train_step(resolve(config, mesh)).compile()


@functools.cache
def captured(config: Config) -> scheduling.Program:
    """The pipelined step as the scheduler sees it: one capture of each configuration, shared
    by the tests that read it (the schedule section changes nothing captured)."""
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel, devices(config))))
    return program


@functools.cache
def trained(config: Config):
    """Every step's metrics, the final state and the state after the first step (on the
    host), from seed 0's batches."""
    mesh, step = compiled(config)
    state = init_train_state(resolve(config, mesh))
    rng = np.random.default_rng(0)
    history = []
    for index in range(STEPS):
        state, metrics = step(state, random_batch(rng, config, mesh))
        history.append(metrics)
        if index == 0:
            first = jax.device_get(state)  # before the next step donates it
    return jax.device_get(history), jax.device_get(state), first


def unstacked(config: Config, params):
    return to_layout(params, stage_layout(config.parallel, config.model.num_layers), None)


def _pipelined_and_plain(case: str) -> tuple[Config, Config]:
    layout, virtual, recompute, fields = CASES[case]
    plain_fields = {k: v for k, v in fields.items() if k not in ("chunk_layers", "zero")}
    return config(layout, 2, virtual, recompute, **fields), config(layout, **plain_fields)


@pytest.mark.parametrize(
    "case",
    [
        # By default uneven chunks run with ZeRO-1 under 1F1B; 1F1B, each alone, and the
        # interleaved schedule with ZeRO-1, are slow.
        pytest.param(case, marks=() if case in DEFAULT_CASES else pytest.mark.slow)
        for case in CASES
    ],
)
def test_the_pipeline_trains_as_the_microbatch_loop(case):
    pipelined, plain = _pipelined_and_plain(case)
    (history, state, first), (expected, expected_state, expected_first) = (
        trained(pipelined),
        trained(plain),
    )
    for key in ("dropped_fraction", "tokens_per_expert"):
        np.testing.assert_array_equal([m[key] for m in history], [m[key] for m in expected])
    assert all(m["dropped_fraction"] > 0 for m in expected)
    for key in ("loss", "total_loss", "aux_loss", "z_loss"):
        np.testing.assert_allclose(
            [m[key] for m in history], [m[key] for m in expected], rtol=5e-6, err_msg=key
        )
    np.testing.assert_allclose(
        [m["grad_norm"] for m in history], [m["grad_norm"] for m in expected], rtol=2e-5
    )
    # The gradients: Adam's first moment after one step is (1 - b1) x the clipped gradient.
    chex.assert_trees_all_close(
        unstacked(pipelined, first.opt_state[0].mu), expected_first.opt_state[0].mu,
        rtol=1e-4, atol=3e-8,
    )  # fmt: skip
    # The parameters: Adam moves a parameter whose gradient nearly cancels by up to lr
    # whatever the gradient's size, so rounding can move a few by far more than most.
    params = unstacked(pipelined, state.params)
    chex.assert_trees_all_close(params, expected_state.params, rtol=0, atol=LR / 10)
    differences = np.concatenate(
        [np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(params),
                                                 jax.tree.leaves(expected_state.params),
                                                 strict=True)]
    )  # fmt: skip
    assert np.quantile(differences, 0.999) < LR / 200


def test_the_paired_schedule_is_bit_for_bit_on_a_pipelined_step():
    # pair moves each backward slot beside the next tick's forward slot and packs the
    # weight gradients into the windows as dw does: one compile covers both rewrites, on
    # the uneven chunks with ZeRO-1 of the default case above (its run is the reference).
    fields = dict(UNEVEN, zero=1)
    scheduled = trained(config("plain", 2, schedule="pair", **fields))
    chex.assert_trees_all_equal(scheduled, trained(config("plain", 2, **fields)))


def test_pair_runs_each_backward_slot_beside_the_next_forward_slot():
    # A slow link: the all-to-alls are long enough for the pairing to fill them.
    plain = config("plain", 2)
    paired = _with(plain, "schedule", name="pair", profile=linked("cpu", 50.0))
    mesh = build_mesh(paired.parallel, devices(paired))
    program = captured(plain)  # the 1F1B case's, as the exchange test reads it

    def neighbours_in_windows(name: str) -> list[int]:
        """Per tick k: compute nodes of tick k+1's forward slot inside the windows of tick
        k's backward all-to-alls, and of tick k's backward slot inside tick k+1's."""
        policy = dataclasses.replace(schedule_policy(paired), name=name)
        scheduled = scheduling.schedule(program, policy, scheduling.cost_model(policy, mesh))
        graph, order = scheduled.graph, scheduled.order.nodes
        position = {node: i for i, node in enumerate(order)}
        assert all(position[p] < position[n] for n in range(len(order)) for p in graph.preds[n])

        def nodes(tick: int, phase: str, role: str) -> list:
            return [n for n in graph.nodes if n.op.name_stack.startswith(f"tick_{tick}/")
                    and n.op.phase.value == phase and n.role.value == role]  # fmt: skip

        def inside(tick: int, phase: str, guest: set[int]) -> int:
            starts = [n for n in nodes(tick, phase, "start") if n.op.primitive == "all_to_all"]
            windows = (order[position[s.id] + 1 : position[s.partner]] for s in starts)
            return sum(n in guest for window in windows for n in window)

        counts = []
        for tick in range(len(TickTable(2, 1, MICROBATCHES).ticks) - 1):
            forward = {n.id for n in nodes(tick + 1, "forward", "compute")}
            backward = {n.id for n in nodes(tick, "backward", "compute")}
            counts.append(inside(tick, "backward", forward) + inside(tick + 1, "forward", backward))
        return counts

    paired_counts, plain_counts = neighbours_in_windows("pair"), neighbours_in_windows("dw")
    # The slots are merged in one order for the whole step, two side by side: by the keys
    # the order takes from it, no third slot is in progress. (A key range per tick over
    # its slots' program positions overlapped the next tick's: a backward slot's own
    # positions lie inside its tick's forward slot's.)
    policy = schedule_policy(paired)
    graph = split_async(program, min_bytes=policy.async_min_bytes)
    seconds = node_seconds(scheduling.cost_model(policy, mesh).rebound(graph.program))
    keys = pair_passes(graph, seconds).priorities
    spans: dict[tuple[int, str], list[float]] = {}
    for node in graph.nodes:
        tick = tick_of(node)
        if tick is not None and node.role is Role.COMPUTE and node.id in keys:
            spans.setdefault((tick, node.op.phase.value), []).append(keys[node.id])
    edges = sorted(key for found in spans.values() for key in (min(found), max(found)))
    assert max(sum(min(f) <= at <= max(f) for f in spans.values()) for at in edges) == 2
    # Tick 0 has no backward slot; every later tick's backward slot meets the next forward.
    assert all(count > 0 for count in paired_counts[1:-1]), paired_counts
    assert not any(plain_counts), plain_counts


@pytest.mark.parametrize("case", ["1f1b", "interleaved"])
def test_stages_exchange_activations_and_gradients_once_a_tick(case):
    pipelined, _ = _pipelined_and_plain(case)
    virtual = pipelined.parallel.virtual_stages
    program = captured(pipelined)
    sends = [op for op in program.ops if op.primitive == "ppermute"]
    assert {op.eqn.params["axis_name"] for op in sends} == {(PIPELINE_AXIS,)}
    # A send after every tick but the last of each pass; none outside the ticks.
    ticks = TickTable(2, virtual, MICROBATCHES).ticks
    forward = sum(tick.has_forward for tick in ticks) - 1
    backward = sum(tick.has_backward for tick in ticks) - 1
    scopes = [op.layer.split("/") for op in sends]
    assert sum("send_activations" in scope for scope in scopes) == forward
    assert sum("send_gradients" in scope for scope in scopes) == backward
    assert all(scope[0].startswith("tick_") for scope in scopes)
    assert not any("microbatch_" in op.name_stack for op in program.ops)


def test_a_recomputed_chunk_selects_its_activations_not_its_parameters():
    """A recomputed chunk keeps its inputs, the parameters among them: a backward slot
    takes its own chunk's parameters instead of selecting one of every candidate forward
    slot's (a copy of a chunk's weights per backward tick)."""
    pipelined, _ = _pipelined_and_plain("interleaved")
    assert pipelined.model.recompute == "layer"
    program = captured(pipelined)
    # A chunk's parameters (and their moments): [virtual, stage block, ...] per device.
    chunk_shapes = {v.aval.shape[2:] for v in program.inputs if v.aval.ndim >= 4}
    selected = [
        op.outputs[0].aval.shape
        for op in program.ops
        if op.primitive == "select_n" and SELECT_SCOPE in op.layer
    ]
    # The chunks' inputs, [rows, positions, width] (positions split over the tensor axis).
    assert any(len(shape) == 3 and shape[-1] == pipelined.model.d_model for shape in selected)
    assert not chunk_shapes & set(selected)


def _saved(tmp_path, pipelined: Config):
    """A state of the pipelined run, checkpointed in ``tmp_path``; and its mesh. The
    initial state with every value moved a little: each leaf its own values and the
    optimizer's moments non-zero, as a trained state's are, with no step compiled."""
    from jaxmoe.train.checkpoint import RunCheckpoints

    mesh = build_mesh(pipelined.parallel, devices(pipelined))
    rng = np.random.default_rng(3)
    saved = jax.tree.map(
        lambda leaf: (
            leaf + rng.uniform(0, 1e-2, leaf.shape).astype(leaf.dtype)
            if np.issubdtype(leaf.dtype, np.floating)
            else leaf
        ),
        jax.device_get(init_train_state(resolve(pipelined, mesh))),
    )
    shardings = jax.tree.map(
        lambda leaf: leaf.sharding, abstract_sharded_state(resolve(pipelined, mesh))
    )
    with RunCheckpoints(tmp_path, resolve(pipelined)) as checkpoints:
        checkpoints.save(jax.device_put(saved, shardings))
        checkpoints.wait()
    return saved, mesh


def _restored_unpipelined(tmp_path, pipelined: Config, plain: Config, saved, step=0):
    """The checkpoint in ``tmp_path`` restored in ``plain``'s layout, on one stage's
    devices, and what it must equal: the saved values unstacked."""
    from jaxmoe.train.checkpoint import RunCheckpoints

    plain_mesh = build_mesh(plain.parallel, devices(plain))
    with RunCheckpoints(tmp_path, resolve(plain, plain_mesh)) as checkpoints:
        restored = checkpoints.restore(step)
    layout = stage_layout(pipelined.parallel, pipelined.model.num_layers)
    return restored, param_trees_mapped(saved, lambda tree: to_layout(tree, layout, None))


def test_a_pipelined_checkpoint_restores_in_every_pipeline_layout(tmp_path):
    from jaxmoe.train.checkpoint import RunCheckpoints

    pipelined, plain = config("plain", 2), config("plain")
    saved, mesh = _saved(tmp_path, pipelined)
    with RunCheckpoints(tmp_path, resolve(pipelined, mesh)) as checkpoints:
        again = checkpoints.restore(0)
    chex.assert_trees_all_equal(jax.device_get(again), saved)
    assert again.params["stage_blocks"][0]["attention_norm"]["scale"].sharding.spec[1] == (
        PIPELINE_AXIS
    )

    # Into the unpipelined layout, on one stage's devices: the same values, unstacked.
    restored, unpipelined = _restored_unpipelined(tmp_path, pipelined, plain, saved)
    chex.assert_trees_all_equal(jax.device_get(restored), unpipelined)

    # And back: the unpipelined checkpoint restores stacked, over the pipeline axis.
    with RunCheckpoints(tmp_path / "plain", resolve(plain)) as checkpoints:
        checkpoints.save(restored)
        checkpoints.wait()
    with RunCheckpoints(tmp_path / "plain", resolve(pipelined, mesh)) as checkpoints:
        stacked = checkpoints.restore(0)
    chex.assert_trees_all_equal(jax.device_get(stacked), saved)
    expert_weight = stacked.params["stage_blocks"][1]["ffn"]["experts"]["w_in"]
    assert expert_weight.sharding.spec == PartitionSpec(None, PIPELINE_AXIS, "expert")


# The checkpoints of uneven chunks and of ZeRO-1 by default in the case that has both,
# whose initial state the equivalence test compiles; each alone is slow.
def _checkpoint_cases(alone: str) -> list:
    return ["uneven-zero1", pytest.param(alone, marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", _checkpoint_cases("uneven"))
def test_an_uneven_checkpoint_restores_without_its_padding(tmp_path, case):
    pipelined, plain = _pipelined_and_plain(case)
    saved, _ = _saved(tmp_path, pipelined)
    # Read in the layout it was written in (chunks of 1 and 2 layers), then unstacked.
    assert stage_layout(pipelined.parallel, pipelined.model.num_layers).counts == (1, 2)
    restored, unpipelined = _restored_unpipelined(tmp_path, pipelined, plain, saved)
    chex.assert_trees_all_equal(jax.device_get(restored), unpipelined)
    assert sorted(restored.params["blocks"]) == [0, 1, 2]
    # The restored state trains in the unpipelined run's step (the equivalence test's).
    plain_mesh, plain_step = compiled(plain)
    _, metrics = plain_step(restored, random_batch(np.random.default_rng(1), plain, plain_mesh))
    assert np.isfinite(metrics["loss"])


@pytest.mark.parametrize("case", _checkpoint_cases("zero1"))
def test_a_distributed_optimizer_checkpoint_restores_unpipelined_and_unsharded(tmp_path, case):
    from jaxmoe.train.checkpoint import RunCheckpoints

    pipelined, plain = _pipelined_and_plain(case)
    saved, mesh = _saved(tmp_path, pipelined)
    # Saved as the shards lie: a stacked block over its stage's replicas (the expert axis),
    # the parameters outside the blocks over the pipeline axis too.
    with RunCheckpoints(tmp_path, resolve(pipelined, mesh)) as checkpoints:
        again = checkpoints.restore(0)
    kernel = again.opt_state[0].mu["stage_blocks"][0]["attention"]["query"]["kernel"]
    assert kernel.sharding.spec == PartitionSpec(None, PIPELINE_AXIS, "expert")
    embedding = again.params["token_embed"]["embedding"]
    assert embedding.sharding.spec == PartitionSpec((PIPELINE_AXIS, "expert"))
    restored, unpipelined = _restored_unpipelined(tmp_path, pipelined, plain, saved)
    chex.assert_trees_all_equal(jax.device_get(restored), unpipelined)


def test_pipelined_evaluation_equals_the_unpipelined_one(tmp_path):
    """The forward slots alone, on rotary positions and documents packed into rows: each
    microbatch's positions and attention segments restart at its documents."""
    from jaxmoe.data.corpus import CorpusInfo, write_info
    from jaxmoe.train.step import build_eval_step

    corpus = tmp_path / "corpus.bin"
    np.arange(64, dtype="<u2").tofile(corpus)
    write_info(corpus, CorpusInfo("uint16", 256, 1, "<eod>", None, documents=1, tokens=64))
    rows = np.random.default_rng(2).integers(2, 256, (16, 17)).astype(np.int32)
    rows[np.arange(16), np.arange(16)] = 1  # one end of document in each row, at another place
    losses = []
    # One MoE layer a stage: stage 1 runs a microbatch while stage 0 runs the next.
    llama = dict(num_layers=2, moe_every=1, position="rope", norm="rmsnorm")
    for each in (config("plain", 2, **llama), config("plain", **llama)):
        data = DataConfig(sources=(DataSource(str(corpus)),), mask_across_documents=True)
        each = dataclasses.replace(each, data=data)
        mesh = build_mesh(each.parallel, devices(each))
        state = init_train_state(resolve(each, mesh))
        batch = jax.device_put(rows, NamedSharding(mesh, token_spec(mesh)))
        evaluate = build_eval_step(resolve(each, mesh)).jit()
        losses.append(float(evaluate(state.params, batch, state.placement, state.model_state)))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_the_flags_set_the_pipeline():
    config = config_from_train_args(
        ["--parallel.pipeline", "2", "--parallel.virtual_stages", "2", "--parallel.expert", "4",
         "--train.microbatches", "4", "--model.num_layers", "4", "--model.moe_every", "1"]
    )  # fmt: skip
    assert (config.parallel.pipeline, config.parallel.virtual_stages) == (2, 2)
    assert config.parallel.num_devices == 8 and config.parallel.token_shards == 4


def _with(base: Config, section: str, **fields) -> Config:
    replaced = dataclasses.replace(getattr(base, section), **fields)
    return dataclasses.replace(base, **{section: replaced})


REFUSED = {
    "unequal chunks": (
        lambda: config("plain", 2, 2, num_layers=6, moe_every=1),
        "model.num_layers=6 does not split into parallel.pipeline x parallel.virtual_stages = 4",
    ),
    "mixed chunk positions": (
        lambda: config("plain", 2, 1, moe_every=4),
        "model.moe_every=4, model.first_dense_layers=0: the chunks",
    ),
    "chunks short of the layers": (
        lambda: config("plain", 2, 1, chunk_layers="1,2"),
        "parallel.chunk_layers='1,2' holds 3 layers, the model 4",
    ),
    "uneven chunks out of step with moe_every": (
        lambda: config("plain", 2, 1, chunk_layers="1,3"),
        "model.moe_every=2, model.first_dense_layers=0: the chunks",
    ),
    "zero 3": (
        lambda: _with(config("plain", 2), "train", zero=3),
        "train.zero=3 with parallel.pipeline=2: fully sharded blocks",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_cannot_compose_is_refused_in_one_line(case):
    build, message = REFUSED[case]
    with pytest.raises(ConfigError, match="^" + message) as refused:
        build()
    assert "\n" not in str(refused.value)


def test_virtual_stages_need_a_pipeline():
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages=2 needs parallel.pipeline"):
        ParallelConfig(virtual_stages=2)
    with pytest.raises(ConfigError, match=r"^parallel.pipeline=0: must be a positive integer"):
        ParallelConfig(pipeline=0)
