"""Gradient accumulation inside the step: M microbatches train as one batch of the same
tokens (the same tokens dropped, losses within float tolerance), on the unfolded layout
and under tensor parallelism; each microbatch is a scope the scheduler sees."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.layers import RoutingStats
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.pipeline.microbatches import combine_stats, microbatch_rows
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step
from tests.train.test_scheduled import run

STEPS = 3
LAYOUTS = {
    "2x4": ParallelConfig(data=2, expert=4),
    "tensor2": ParallelConfig(data=2, expert=4, tensor=2),
}


def config(parallel: ParallelConfig, microbatches: int) -> Config:
    # With 3 microbatches this is tests/train/test_pair_schedule.py's reference: one program.
    return Config(
        model=ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        parallel=parallel,
        train=TrainConfig(batch_size=24, warmup_steps=1, learning_rate=1e-2,
                          microbatches=microbatches),
    )  # fmt: skip


@functools.cache
def trained(layout: str, microbatches: int):
    return run(config(LAYOUTS[layout], microbatches), steps=STEPS)


@pytest.mark.parametrize(
    # Tensor parallelism splits the microbatches' rows no differently: another layout.
    "layout",
    ["2x4", pytest.param("tensor2", marks=pytest.mark.slow)],
)
def test_three_microbatches_train_as_one_batch(layout):
    (whole, whole_state), (parts, parts_state) = trained(layout, 1), trained(layout, 3)
    # The same tokens drop: routing groups are whole rows, microbatches whole rows too.
    for key in ("dropped_fraction", "tokens_per_expert"):
        np.testing.assert_array_equal([m[key] for m in parts], [m[key] for m in whole])
    assert all(m["dropped_fraction"] > 0 for m in whole)
    # Sums in another order: within a few float32 ulps per step.
    for key in ("loss", "total_loss", "aux_loss", "z_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in parts], [m[key] for m in whole], rtol=2e-6, err_msg=key
        )
    for got, want in zip(jax.tree.leaves(parts_state.params), jax.tree.leaves(whole_state.params),
                         strict=True):  # fmt: skip
        # Adam divides each gradient by its own scale: a weight whose gradient is near
        # zero moves by up to a step (1e-2) on a few ulps of difference; 1% of one step.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_each_microbatch_is_a_scope_of_the_captured_step():
    mesh = build_mesh(LAYOUTS["2x4"])
    program, _ = capture_train_step(resolve(config(LAYOUTS["2x4"], 3), mesh))
    scopes = {op.layer.split("/")[0] for op in program.ops if op.layer.startswith("microbatch_")}
    assert scopes == {f"microbatch_{i}" for i in range(3)}
    one, _ = capture_train_step(resolve(config(LAYOUTS["2x4"], 1), mesh))
    assert not any("microbatch" in op.name_stack for op in one.ops)


def test_microbatches_cut_whole_rows_and_stats_combine():
    rows = jnp.arange(8 * 3).reshape(8, 3)
    pieces = microbatch_rows(rows, 4)
    assert [p.shape for p in pieces] == [(2, 3)] * 4
    np.testing.assert_array_equal(jnp.concatenate(pieces), rows)
    with pytest.raises(ValueError, match="3 microbatches"):
        microbatch_rows(rows, 3)
    a = RoutingStats(jnp.float32(1.0), jnp.float32(2.0), jnp.float32(0.0), jnp.array([1, 2]),
                     jnp.int32(1), jnp.int32(6))  # fmt: skip
    b = a._replace(aux_loss=jnp.float32(3.0), tokens_per_expert=jnp.array([3, 0]))
    both = combine_stats([a, b])
    assert float(both.aux_loss) == 2.0 and both.tokens_per_expert.tolist() == [4, 2]
    assert int(both.assignments) == 12 and both.slot_load is None
