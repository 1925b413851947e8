"""Multi-token prediction trains (``model.mtp_depth``): its loss is in the metrics and
weighted into the total, each module counts the targets that exist, and heads split over
a tensor group with sequence parallelism train as the unfolded layout does (the modules'
shifted tokens are sliced as the model's are)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.losses import ahead_cross_entropy
from tests.train.batches import train_steps

# DeepSeek-V3's layer plan, small: a leading dense layer, an MoE layer, two modules (the
# second one's block an MoE block), no routers' losses (so the total is the two losses).
# Latent attention's heads over a tensor group are checked in tests/layers.
MODEL = ModelConfig(
    d_model=32, num_heads=4, num_layers=2, d_ff=64, seq_len=16, moe_every=1,
    first_dense_layers=1, norm="rmsnorm", position="rope", activation="swiglu",
    linear_bias=False, tie_embeddings=False, mtp_depth=2, mtp_loss_weight=0.5,
)  # fmt: skip
MOE = MoEConfig(
    num_experts=8, top_k=2, capacity_factor=1.0, score_function="sigmoid",
    num_expert_groups=4, top_k_expert_groups=2, expert_bias_rate=1e-2, aux_loss_coef=0.0,
    z_loss_coef=0.0,
)  # fmt: skip


UNFOLDED = ParallelConfig(data=2, expert=4)


def config(parallel: ParallelConfig) -> Config:
    return Config(
        model=MODEL,
        moe=MOE,
        parallel=parallel,
        train=TrainConfig(batch_size=16, steps=2, warmup_steps=1, learning_rate=1e-2),
    )


def test_the_modules_loss_is_weighted_into_the_total():
    reference, _ = train_steps(config(UNFOLDED))
    # The modules' MoE blocks route as the model's layers do: a row each.
    assert reference[0]["tokens_per_expert"].shape == (len(MODEL.moe_layers), 8)
    for m in reference:
        assert math.isclose(m["total_loss"], m["loss"] + 0.5 * m["mtp_loss"], rel_tol=1e-5), m
        # Random tokens: each module's loss is near the model's.
        assert abs(m["mtp_loss"] - m["loss"]) < 0.1 * m["loss"]


# By default DeepSeek-V3's module (one, its block an MoE block) trains split over tensor and
# context groups as on whole sequences, every metric compared (tests/train/
# test_context_parallel.py); two modules under a tensor group are slow.
@pytest.mark.slow
def test_folded_layouts_train_as_the_unfolded_one_with_the_modules():
    reference, _ = train_steps(config(UNFOLDED))
    folded, _ = train_steps(config(ParallelConfig(data=2, expert=4, tensor=2)))
    for name in ("loss", "mtp_loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[name] for m in folded], [m[name] for m in reference], rtol=1e-5, err_msg=name
        )
    np.testing.assert_array_equal(
        [m["tokens_per_expert"] for m in folded], [m["tokens_per_expert"] for m in reference]
    )


@pytest.mark.parametrize("k", [1, 2])
def test_each_module_counts_the_targets_that_exist(k):
    """Uniform logits: the loss is ln(vocab) times the counted targets over the scaled
    denominator. A row of 8 targets with a document end (id 0) as input 3: module k's
    position i counts where i + k + 1 is in the row and inputs i .. i + k are not an end."""
    vocab, eod = 5, 0
    batch = jnp.asarray([[1, 2, 3, eod, 4, 1, 2, 3, 4]], jnp.int32)
    logits = jnp.zeros((1, 8, vocab), jnp.float32)
    inputs = np.asarray(batch[0, :-1])
    counted = [
        i for i in range(8) if i + k < 8 and all(inputs[j] != eod for j in range(i, i + k + 1))
    ]
    for eod_id, expected in ((None, 8 - k), (eod, len(counted))):
        loss = ahead_cross_entropy(logits, batch, k, eod_id, jnp.float32(8))
        assert math.isclose(float(loss), math.log(vocab) * expected / (8 - k), rel_tol=1e-6)


def test_the_modules_expert_biases_take_the_rows_after_the_models():
    """Block indices sort the model's biases; a module's (under ``mtp``) comes after them
    whatever its own index."""
    from jaxmoe.train.step import _update_expert_biases

    zeros = jnp.zeros(2, jnp.float32)
    state = {"blocks": {1: {"b": zeros}, 2: {"b": zeros}}, "mtp": {0: {"block": {"b": zeros}}}}
    load = jnp.asarray([[2.0, 0.0], [0.0, 2.0], [0.0, 2.0]])
    moved = _update_expert_biases(state, load, 1.0)
    np.testing.assert_array_equal(moved["blocks"][1]["b"], [-1.0, 1.0])
    np.testing.assert_array_equal(moved["blocks"][2]["b"], [1.0, -1.0])
    np.testing.assert_array_equal(moved["mtp"][0]["block"]["b"], [1.0, -1.0])
