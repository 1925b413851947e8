"""``train.zero``: the distributed optimizer (1) and fully sharded parameters (3).

Both train as the plain step does, over 5 steps, on the (2, 4) mesh in float32 and on a
folded layout (tensor 2) in bfloat16: the same losses and gradient norms to float
tolerance (the sums are grouped otherwise: a reduce-scatter, then a psum of what is left)
and the same parameters, which the state now holds as shards. A gradient reduced over a
wrong axis breaks these comparisons (checked by hand: summing ZeRO-1's gradients over
one replicated axis fewer moves the second loss by about 1e-3). Every schedule computes
a ZeRO step exactly (``dw`` tested here). A checkpoint saved with or without ZeRO
restores with or without it, and into other layouts. The memory of the state is the
shards' (XLA's argument sizes agree to the byte), and a ZeRO-3 step keeps no block's
gathered parameters for its backward pass.

Compiled steps are shared through a module cache: one per configuration; so are the captured
steps the scheduler reads.
"""

import dataclasses
import functools

import chex
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxmoe.config import Config, ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.parallel.zero import shard_layout, sharded_spec
from jaxmoe.plan.state_memory import memory_per_device
from jaxmoe.train.checkpoint import RunCheckpoints
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step
from jaxmoe.train.state import abstract_sharded_state, init_train_state
from scheduling import Phase, saved_for_backward
from scheduling.program.capture import Program
from scheduling.program.collective_purpose import collective_purposes
from tests.train.batches import random_batch
from tests.train.runs import with_schedule

STEPS = 5
LAYOUTS = {
    "2x4": (ParallelConfig(data=2, expert=4), "float32"),
    "tensor2-bf16": (ParallelConfig(data=2, expert=4, tensor=2), "bfloat16"),
}


def config_for(layout: str, zero: int, **train_fields) -> Config:
    parallel, dtype = LAYOUTS[layout]
    # In bfloat16 the dense attention core: with the blockwise one, ZeRO-3's third loss is
    # 4e-4 from the plain step's (float32: within 1e-5), too near the 1e-3 a wrong
    # reduction makes (tests/train/test_attention_layouts.py trains it under ZeRO-3).
    attention = "dense" if dtype == "bfloat16" else "auto"
    return Config(
        model=ModelConfig(
            d_model=32,
            num_heads=2,
            num_layers=2,
            d_ff=64,
            seq_len=16,
            moe_every=2,
            dtype=dtype,
            attention=attention,
        ),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        parallel=parallel,
        train=TrainConfig(
            batch_size=16, warmup_steps=1, learning_rate=1e-2, zero=zero, **train_fields
        ),
    )


@functools.cache
def compiled(config: Config):
    mesh = build_mesh(config.parallel)
    return mesh, scheduled_train_step(resolve(config, mesh)).compile()


@functools.cache
def captured(zero: int, recompute: str = "none") -> Program:
    """The step on the (2, 4) mesh as the scheduler sees it, one capture per ZeRO stage
    (and recomputation)."""
    config = config_for("2x4", zero=zero)
    if recompute != "none":
        model = dataclasses.replace(config.model, recompute=recompute)
        config = dataclasses.replace(config, model=model)
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel)))
    return program


@functools.cache
def run(config: Config, steps: int = STEPS):
    """Metrics of every step and the final state, on the host."""
    mesh, step = compiled(config)
    state = init_train_state(resolve(config, mesh))
    rng = np.random.default_rng(1)
    history = []
    for _ in range(steps):
        state, metrics = step(state, random_batch(rng, config, mesh))
        history.append(metrics)
    return jax.device_get(history), jax.device_get(state)


def assert_same_training(ours, reference, bfloat16: bool = False):
    """In bfloat16 the gradients differ by bfloat16 ulps (the moments' tolerance that of
    bfloat16, 1e-2, instead of 1e-4 and 1e-7), and AdamW divides a gradient near zero by
    its own size, so a few ulps there move a weight by up to the learning rate's order
    (the parameters' atol 1e-3, not 1e-4)."""
    atol, moments = (1e-3, (1e-2, 1e-5)) if bfloat16 else (1e-4, (1e-4, 1e-7))
    (history, state), (reference_history, reference_state) = ours, reference
    for name in ("loss", "total_loss", "grad_norm", "aux_loss"):
        np.testing.assert_allclose(
            [m[name] for m in history],
            [m[name] for m in reference_history],
            rtol=1e-5,
            err_msg=name,
        )
    np.testing.assert_array_equal(
        history[-1]["tokens_per_expert"], reference_history[-1]["tokens_per_expert"]
    )
    # Global arrays: the same parameters and moments whichever device holds which shard.
    chex.assert_trees_all_close(state.params, reference_state.params, rtol=1e-4, atol=atol)
    chex.assert_trees_all_close(
        state.opt_state, reference_state.opt_state, rtol=moments[0], atol=moments[1]
    )


# -------------------------------------------------------------------------------------
# Layout: no compilation.


def test_a_parameter_is_sharded_over_the_replicas_that_hold_it():
    axes = {"data": 2, "expert": 4}
    # A dense weight, replicated everywhere: all 8 replicas, first dimension.
    dense = shard_layout((64, 192), P(), axes)
    assert (dense.dim, dense.axes, dense.leftover, dense.shards) == (0, ("data", "expert"), (), 8)
    assert sharded_spec(P(), dense) == P(("data", "expert"))
    # An expert weight, split over the expert axis: its expert-data replicas, after it.
    expert = shard_layout((8, 64, 128), P("expert"), axes)
    assert (expert.dim, expert.axes) == (0, ("data",))
    assert sharded_spec(P("expert"), expert) == P(("expert", "data"))
    # Where no dimension takes every replica, the largest set that divides one does; the
    # rest stay replicated (their psum remains).
    odd = shard_layout((6, 3), P(), axes)
    assert (odd.dim, odd.axes, odd.leftover) == (0, ("data",), ("expert",))
    assert shard_layout((3,), P(), axes).axes == ()


def test_plans_on_a_folded_layout_keep_the_axes_a_dimension_is_split_over_first():
    config = config_for("tensor2-bf16", zero=1)
    plan = resolve(config).zero
    attention = plan.specs["blocks"][0]["attention"]
    # The row-parallel output projection: split over tensor on its rows, then sharded.
    assert attention["out"]["kernel"] == P(("tensor_expert", "data", "expert"))
    assert attention["query"]["kernel"] == P(("data", "expert"), "tensor_expert")
    assert plan.specs["blocks"][1]["ffn"]["experts"]["w_in"] == P(
        ("expert", "tensor_expert", "data")
    )
    # Gathered in bfloat16 where the model reads a parameter once, cast to it; the router
    # (float32 logits) and the tied embedding (read twice) in float32.
    dtypes = plan.gather_dtypes
    assert dtypes["blocks"][0]["attention"]["query"]["kernel"] == "bfloat16"
    assert dtypes["blocks"][1]["ffn"]["router"]["kernel"] == "float32"
    assert dtypes["token_embed"]["embedding"] == "float32"


@pytest.mark.parametrize(
    "grad_sync", ["auto", "hierarchical", "int8", "decentralized", "decentralized-int8", "delayed"]
)
def test_gradient_syncs_that_do_not_shard_are_refused_in_one_line(grad_sync):
    with pytest.raises(ConfigError, match=rf"^train.grad_sync={grad_sync} with train.zero=1: "):
        TrainConfig(zero=1, grad_sync=grad_sync)
    TrainConfig(zero=0, grad_sync=grad_sync)


def test_zero_two_is_refused():
    with pytest.raises(ConfigError, match=r"^train.zero=2: choose one of 0, 1, 3$"):
        TrainConfig(zero=2)


# -------------------------------------------------------------------------------------
# Training.


@pytest.mark.parametrize(
    ("zero", "layout"),
    [
        (1, "2x4"),
        pytest.param(1, "tensor2-bf16", marks=pytest.mark.slow),  # ZeRO-3 covers the layout
        pytest.param(3, "2x4", marks=pytest.mark.slow),  # ZeRO-1 covers the layout
        (3, "tensor2-bf16"),
    ],
)
def test_zero_trains_as_the_plain_step(layout, zero):
    # In bfloat16 a sum grouped otherwise can round a weight's bfloat16 copy the other way
    # once its master copy moves by an ulp; the model amplifies that from the fourth step
    # on (5e-3 in the gradient norm by the fifth): compared over 3 steps.
    bfloat16 = LAYOUTS[layout][1] == "bfloat16"
    steps = 3 if bfloat16 else STEPS
    assert_same_training(
        run(config_for(layout, zero=zero), steps), run(config_for(layout, zero=0), steps), bfloat16
    )


def test_bucketed_distributed_optimizer_reduces_as_allreduce():
    """Several buckets of 4 KiB, each one reduce-scatter of rows of shards."""
    bucketed = run(config_for("2x4", zero=1, grad_sync="bucketed", grad_bucket_bytes=4096))
    assert_same_training(bucketed, run(config_for("2x4", zero=1)))


def test_the_state_holds_shards():
    config = config_for("2x4", zero=1)
    _, state = run(config)
    mesh, _ = compiled(config)
    fresh = init_train_state(resolve(config, mesh))
    kernel = fresh.params["blocks"][0]["attention"]["query"]["kernel"]
    assert kernel.shape == (32, 2, 16)  # [d_model, heads, head_dim]: as without ZeRO
    assert kernel.sharding.spec == P(("data", "expert"))
    assert kernel.addressable_shards[0].data.shape == (4, 2, 16)
    mu = fresh.opt_state[0].mu["blocks"][0]["attention"]["query"]["kernel"]
    assert mu.sharding.spec == P(("data", "expert"))
    assert state.params["blocks"][0]["attention"]["query"]["kernel"].shape == (32, 2, 16)


# A schedule that packs dW work (pair) is bit for bit on a ZeRO-1 step by default in
# tests/pipeline/test_pipelined.py; dw on the unpipelined ZeRO steps is slow.
@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_dw_schedule_is_exact_on_a_zero_step(zero):
    config = config_for("2x4", zero=zero)
    scheduled = run(with_schedule(config, "dw"), steps=3)
    chex.assert_trees_all_equal(scheduled, run(config, steps=3))


# -------------------------------------------------------------------------------------
# Memory.


def test_state_memory_is_what_xla_passes_the_step():
    sizes = {}
    for zero in (0, 1, 3):
        config = config_for("2x4", zero=zero)
        memory = memory_per_device(config)
        analysis = compiled(config)[1].memory_analysis()
        rows = config.train.batch_size // config.parallel.batch_shards
        batch = rows * (config.model.seq_len + 1) * 4
        assert analysis.argument_size_in_bytes == memory.parameters + memory.optimizer + batch
        sizes[zero] = memory
    plain, zero1, zero3 = sizes[0], sizes[1], sizes[3]
    assert zero1.parameters < plain.parameters / 3 and zero1.optimizer < plain.optimizer / 3
    assert zero1.gradients == plain.gradients and zero1.gathered == plain.parameters
    assert zero3.gradients < plain.gradients and zero3.gathered < zero1.gathered


@pytest.mark.parametrize("recompute", ["none", "matmuls"])
def test_a_fully_sharded_step_keeps_no_gathered_block_for_the_backward_pass(recompute):
    """Also where the recomputation keeps the exchanges' results (matmuls): the blocks'
    gathers are gathered again, not kept (jaxmoe/layers/recompute.py)."""

    def saved_from_gathers(zero: int) -> int:
        return saved_for_backward(
            captured(zero, recompute), made_by=lambda op: "param_gather/layer_" in op.layer
        ).count

    assert saved_from_gathers(1)  # ZeRO-1 keeps its gathered parameters through the step
    assert saved_from_gathers(3) == 0


# -------------------------------------------------------------------------------------
# Checkpoints.


@pytest.mark.parametrize(
    ("saved", "restored"),
    [
        ((1, "2x4"), (0, "2x4")),
        ((0, "2x4"), (3, "2x4")),
        ((3, "2x4"), (1, "4x2")),
        # ZeRO-1 into no ZeRO on another layout: zero1 -> zero0 and zero3 -> another layout
        # run by default.
        pytest.param((1, "2x4"), (0, "tensor2"), marks=pytest.mark.slow),
    ],
    ids=lambda case: f"zero{case[0]}-{case[1]}",
)
def test_a_checkpoint_restores_across_zero_and_layouts(tmp_path, saved, restored):
    saved_config = config_for("2x4", zero=saved[0])
    mesh, step = compiled(saved_config)
    rng = np.random.default_rng(0)
    state, _ = step(
        init_train_state(resolve(saved_config, mesh)), random_batch(rng, saved_config, mesh)
    )
    with RunCheckpoints(tmp_path, resolve(saved_config)) as checkpoints:
        checkpoints.save(state)
        checkpoints.wait()
    state = jax.device_get(state)

    zero, layout = restored
    parallel = {
        "2x4": ParallelConfig(data=2, expert=4),
        "4x2": ParallelConfig(data=4, expert=2),
        "tensor2": ParallelConfig(data=2, expert=4, tensor=2),
    }[layout]
    config = dataclasses.replace(
        saved_config,
        parallel=parallel,
        train=dataclasses.replace(saved_config.train, zero=zero),
    )
    new_mesh = build_mesh(config.parallel)
    with RunCheckpoints(tmp_path, resolve(config, new_mesh)) as checkpoints:
        restored_state = checkpoints.restore(1)
    chex.assert_trees_all_equal(jax.device_get(restored_state), state)
    expected_spec = resolve(config).zero.specs if zero else None
    kernel = restored_state.params["blocks"][0]["attention"]["query"]["kernel"]
    if expected_spec is not None:
        assert kernel.sharding.spec == expected_spec["blocks"][0]["attention"]["query"]["kernel"]
    # Every leaf as the step on the new layout takes it (its compiled step refuses any other
    # sharding); the restored state trains where that step is compiled by the tests above.
    taken = abstract_sharded_state(resolve(config, new_mesh))
    for leaf, wanted in zip(jax.tree.leaves(restored_state), jax.tree.leaves(taken), strict=True):
        assert (leaf.shape, leaf.dtype) == (wanted.shape, wanted.dtype)
        assert leaf.sharding.is_equivalent_to(wanted.sharding, leaf.ndim), wanted.sharding
    if layout == "2x4":
        _, metrics = compiled(config)[1](restored_state, random_batch(rng, config, new_mesh))
        assert np.isfinite(metrics["loss"])


def test_the_report_names_the_parameter_gathers():
    program = captured(3)
    purposes = collective_purposes(program)
    gathers = [op for op in program.collectives() if "param_gather/layer_1" in op.layer]
    # Block 1's gathers run twice: before its forward pass and again before its backward.
    assert {op.phase for op in gathers} == {Phase.FORWARD, Phase.BACKWARD}
    assert {purposes[op] for op in gathers} == {"parameter all_gather"}
