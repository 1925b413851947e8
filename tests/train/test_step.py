"""The per-device train step computes the same training on every mesh.

Routing groups are sequences, so which tokens are dropped does not depend on
how the batch is sharded; the runs differ only in the order of floating-point
reductions.
"""

import functools

import jax
import numpy as np
import pytest

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from tests.train.batches import train_steps
from tests.train.runs import assert_trained_close

STEPS = 5


def small_config(parallel: ParallelConfig, moe: MoEConfig) -> Config:
    """The model, routing and training of tests/train/test_scheduled.py's ``small``: on
    (2, 4) with top-2 at capacity 1.0, its compiled step is theirs (and test_zero's)."""
    return Config(
        model=ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16),
        moe=moe,
        parallel=parallel,
        train=TrainConfig(batch_size=16, warmup_steps=1, learning_rate=1e-2),
    )


@functools.cache
def run_steps(config: Config, devices: tuple[jax.Device, ...] | None = None):
    """The first STEPS steps of ``config``: each step's metrics and the final parameters."""
    return train_steps(config, devices, steps=STEPS)


@functools.cache
def reference_run(moe: MoEConfig):
    """The steps on one device: what every mesh must train."""
    return run_steps(small_config(ParallelConfig(1, 1), moe), tuple(jax.devices()[:1]))


@pytest.mark.parametrize(
    "moe",
    [
        MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        pytest.param(
            MoEConfig(num_experts=8, top_k=1, capacity_factor=None), marks=pytest.mark.slow
        ),
    ],
    ids=["top2-capacity", "top1-dropless"],
)
# Experts over all 8 devices (1x8) is another mesh for the claim 2x4 checks: slow.
@pytest.mark.parametrize(
    "mesh", [(2, 4), pytest.param((1, 8), marks=pytest.mark.slow)], ids=["2x4", "1x8"]
)
def test_same_training_on_every_mesh(moe, mesh):
    reference, reference_params = reference_run(moe)
    losses = [m["loss"] for m in reference]
    assert losses[-1] < losses[0]
    if moe.dropless:
        assert all(m["dropped_fraction"] == 0 for m in reference)
    else:
        assert all(m["dropped_fraction"] > 0 for m in reference)
    history, params = run_steps(small_config(ParallelConfig(*mesh), moe))
    for name in ("loss", "aux_loss", "z_loss", "dropped_fraction", "grad_norm"):
        np.testing.assert_allclose(
            [m[name] for m in history], [m[name] for m in reference], rtol=2e-5, err_msg=name
        )
    np.testing.assert_array_equal(
        history[-1]["tokens_per_expert"], reference[-1]["tokens_per_expert"]
    )
    # Adam divides by sqrt(v): where a gradient cancels, its round-off moves the element
    # by up to one update (lr = 1e-2); all but a few elements agree to 1e-4.
    assert_trained_close(params, reference_params, rtol=1e-4, atol=1e-4, update=1e-2)


def test_metrics_describe_the_routing():
    config = small_config(ParallelConfig(2, 4), MoEConfig(num_experts=8, top_k=2))
    history, _ = run_steps(config)
    first = history[0]
    tokens = config.train.batch_size * config.model.seq_len
    per_expert = np.asarray(first["tokens_per_expert"])
    assert per_expert.shape == (len(config.model.moe_layers), 8)
    assert (per_expert.sum(axis=1) == tokens * 2).all()
    expected_imbalance = (per_expert.max(axis=1) / per_expert.mean(axis=1)).max()
    np.testing.assert_allclose(first["expert_imbalance"], expected_imbalance, rtol=1e-6)
    assert 0 <= first["dropped_fraction"] < 1
