"""``train.grad_reduce_dtype bfloat16``: the gradients are summed across replicas in
bfloat16 (Megatron-Core's ``--grad-reduce-in-bf16``) and cast back to float32 for the
optimizer, with the exact algorithms and ZeRO-1; the others are refused in one line.

In the captured step every reduction of the optimizer phase takes bfloat16 operands (none
without the option); over 3 steps the losses stay within 1e-3 relative of the float32
reduction's and the gradient norms within 1e-2 (a sum of 2 replicas rounded to 8 bits
of mantissa). Its effect on a longer run: experiments/results/grad_reduce_dtype.md.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import ConfigError, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step
from scheduling.program.capture import Phase
from tests.train.batches import train_steps
from tests.train.test_step import small_config

REDUCTIONS = {"psum", "psum_invariant", "reduce_scatter"}


def _config(grad_reduce_dtype: str = "float32", zero: int = 0):
    config = small_config(ParallelConfig(2, 4), MoEConfig(num_experts=8, top_k=2))
    train = dataclasses.replace(config.train, grad_reduce_dtype=grad_reduce_dtype, zero=zero)
    return dataclasses.replace(config, train=train)


def _reduction_dtypes(config) -> list:
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel)))
    return [
        op.inputs[0].aval.dtype
        for op in program.ops
        if op.phase is Phase.OPTIMIZER and op.primitive in REDUCTIONS and op.inputs[0].aval.shape
    ]


@pytest.mark.parametrize("zero", [0, 1])
def test_the_gradients_are_summed_in_bfloat16(zero):
    narrow = _reduction_dtypes(_config("bfloat16", zero))
    assert narrow and all(dtype == jnp.bfloat16 for dtype in narrow)
    assert jnp.bfloat16 not in _reduction_dtypes(_config("float32", zero))


def test_bfloat16_sums_train_as_float32_sums_within_their_rounding():
    reference, _ = train_steps(_config(), steps=3)
    narrow, params = train_steps(_config("bfloat16"), steps=3)
    for name, rtol in (("loss", 1e-3), ("grad_norm", 1e-2)):
        np.testing.assert_allclose(
            [m[name] for m in narrow], [m[name] for m in reference], rtol=rtol, err_msg=name
        )
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(grad_sync="int8"), "train.grad_reduce_dtype=bfloat16 with train.grad_sync=int8: "),
        (dict(zero=3), "train.grad_reduce_dtype=bfloat16 with train.zero=3: "),
        (dict(grad_reduce_dtype="float16"), "train.grad_reduce_dtype='float16': choose one of"),
    ],
)
def test_what_cannot_sum_in_bfloat16_is_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**{"grad_reduce_dtype": "bfloat16", **fields})
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
