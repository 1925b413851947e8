"""Multi-token prediction's modules (jaxmoe/layers/multi_token.py): module ``k`` at position
``i`` reads exactly the tokens up to ``i + k``, the model without modules is the model it
was, and the modules' MoE blocks are layers after the model's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import ConfigError, ModelConfig, MoEConfig, ParallelConfig
from jaxmoe.config.parallel import check_pipeline
from jaxmoe.config.train import TrainConfig
from jaxmoe.layers import GPTMoE

SEQ = 10
MODEL = ModelConfig(
    vocab_size=64, d_model=16, num_heads=2, num_layers=2, d_ff=32, seq_len=SEQ,
    moe_every=1, norm="rmsnorm", position="rope", activation="swiglu", linear_bias=False,
    tie_embeddings=False, mtp_depth=2,
)  # fmt: skip
MOE = MoEConfig(num_experts=4, top_k=2, capacity_factor=None)


@functools.cache
def model() -> GPTMoE:
    """The model with two modules, built by the first test that reads it (not when the
    module is collected, in every process of the run)."""
    return GPTMoE(MODEL, MOE, rngs=nnx.Rngs(0))


@functools.partial(jax.jit, static_argnums=0)
def _ahead(graphdef, state, rows):
    return nnx.merge(graphdef, state).outputs(rows[:, :-1], next_tokens=rows[:, 1:]).ahead


@pytest.mark.parametrize("changed", [3, 6, SEQ])
def test_module_k_at_position_i_reads_the_tokens_up_to_i_plus_k(changed):
    """Changing token ``j`` of a row changes module ``k``'s logits from position ``j - k``
    on, and none before it (the model's own logits from position ``j``)."""
    rows = np.random.default_rng(0).integers(0, 64, (2, SEQ + 1)).astype(np.int32)
    other = rows.copy()
    other[:, changed] = (other[:, changed] + 1) % 64
    graphdef, state = nnx.split(model())
    before, after = _ahead(graphdef, state, rows), _ahead(graphdef, state, other)
    for k, (a, b) in enumerate(zip(before, after, strict=True), start=1):
        first = changed - k
        np.testing.assert_array_equal(a[:, :first], b[:, :first], err_msg=f"module {k}")
        assert np.abs(a[:, first] - b[:, first]).max() > 1e-6, f"module {k}"


def test_without_modules_the_model_is_unchanged():
    plain = GPTMoE(dataclasses.replace(MODEL, mtp_depth=0), MOE, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(plain))
    assert "mtp" not in params
    # The modules are added after everything else: the model's own parameters and logits
    # are those of the model without them.
    with_modules = nnx.to_pure_dict(nnx.state(model()))
    equal = jax.tree.map(np.array_equal, {k: with_modules[k] for k in params}, params)
    assert all(jax.tree.leaves(equal))
    rows = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, SEQ)), jnp.int32)
    np.testing.assert_array_equal(plain(rows)[0], model()(rows)[0])


def test_the_modules_blocks_are_layers_after_the_models():
    assert MODEL.moe_layers == (0, 1, 2, 3)
    assert dataclasses.replace(MODEL, moe_every=2).moe_layers == (1, 3)
    assert model().mtp[0].block.is_moe


def test_bad_depths_and_a_pipeline_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"model.mtp_depth=10: must be an integer from 0"):
        dataclasses.replace(MODEL, mtp_depth=SEQ)
    with pytest.raises(ConfigError, match=r"model.mtp_loss_weight=-1.0: must be >= 0"):
        dataclasses.replace(MODEL, mtp_loss_weight=-1.0)
    parallel = ParallelConfig(data=1, expert=2, pipeline=2)
    with pytest.raises(ConfigError, match=r"model.mtp_depth=2 with parallel.pipeline=2: the"):
        check_pipeline(parallel, MODEL, TrainConfig(batch_size=8, microbatches=2))
