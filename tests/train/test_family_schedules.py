"""Every schedule on every model family: the losses of the scheduled step equal the step
as written (``none``) within 1e-5 relative, and the same tokens drop.

Each family is its ``-tiny`` preset cut to one MoE layer of width 32 (sequence 16), so
that its blocks (grouped-query attention, rotary positions, query/key norms, SwiGLU,
shared experts and their gate, DeepSeek's latent attention, routing with its selection
bias and multi-token prediction, an untied head, FP8 GEMMs) all run in the scheduled
program; capacity 1.0, so that drops happen and must match. (A dense layer's weight
gradients are placed by dw as an MoE layer's dense ones are: tests/train/test_scheduled.py.)
"""

import dataclasses
import functools

import numpy as np
import pytest

from jaxmoe.config import Config, ParallelConfig
from jaxmoe.presets import preset
from scheduling import ExperimentalOptions
from tests.train.runs import with_schedule
from tests.train.test_scheduled import run

# "+fp8": the family with its GEMMs in FP8 (model.fp8 blockwise: DeepSeek-V3's scales).
FAMILIES = (
    "mixtral-tiny",
    "qwen2_moe-tiny",
    "qwen3_moe-tiny",
    "deepseek_v3-tiny",
    "deepseek_v3-tiny+fp8",
)
SCHEDULES = ("async", "dw", "partition", "lancet", "comet", "lancet+comet", "expert_pipeline")
STEPS = 2
# By default DeepSeek-V3 with its GEMMs in FP8 runs the composed schedule (lancet+comet:
# split collectives, partitioned ranges, decomposed exchanges, placed dW work) with drops:
# the same program as without FP8 but for the quantization around each product, whose
# float8 values the schedule moves like any other. Mixtral's blocks
# (grouped-query attention, rotary positions, SwiGLU, softmax top-k renormalised) run it by
# default in tests/train/test_ragged_dropless.py (dropless, ragged); Qwen3-MoE adds to them
# query/key norms and a head width of its own, elementwise on the heads and a shape; Qwen2-
# MoE's shared expert is DeepSeek's too (its gate, attention biases and unnormalised top-k
# are elementwise on the same values): all three are slow. Each schedule alone is exact on
# the default model by default (test_scheduled, test_partitioned, test_comet,
# test_ragged_dropless). The rest of the cross product is slow.
DEFAULT_CASES = {("deepseek_v3-tiny+fp8", "lancet+comet")}
CASES = [
    pytest.param(
        name, schedule, marks=() if (name, schedule) in DEFAULT_CASES else pytest.mark.slow
    )
    for name in FAMILIES
    for schedule in SCHEDULES
]


@functools.cache
def family(name: str) -> Config:
    name, _, fp8 = name.partition("+")
    config = preset(name)
    model = dataclasses.replace(
        config.model,
        fp8="blockwise" if fp8 else "none",
        d_model=32,
        num_layers=1,
        first_dense_layers=0,
        seq_len=16,
        head_dim=16 if config.model.head_dim else None,
        d_ff=64,
    )
    moe = dataclasses.replace(
        config.moe,
        capacity_factor=1.0,
        d_expert=16 if config.moe.d_expert else None,
        d_shared_expert=32 if config.moe.d_shared_expert else None,
    )
    train = dataclasses.replace(config.train, batch_size=16, warmup_steps=1)
    return dataclasses.replace(
        config, model=model, moe=moe, train=train, parallel=ParallelConfig(data=2, expert=4)
    )


@functools.cache
def reference(name: str):
    return run(with_schedule(family(name), "none"), steps=STEPS)


@pytest.mark.parametrize(("name", "schedule"), CASES)
def test_every_schedule_trains_each_family_as_written(name, schedule):
    config = with_schedule(
        family(name),
        schedule,
        partition_chunks=2 if schedule in ("partition", "expert_pipeline") else None,
    )
    always = ExperimentalOptions(partition_always=schedule in ("partition", "lancet"))
    (history, _), (expected, _) = run(config, STEPS, always), reference(name)
    for key in ("loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in history], [m[key] for m in expected], rtol=1e-5, err_msg=key
        )
    for key in ("dropped_fraction", "tokens_per_expert"):
        np.testing.assert_array_equal(
            [m[key] for m in history], [m[key] for m in expected], err_msg=key
        )
    assert any(m["dropped_fraction"] > 0 for m in expected)
