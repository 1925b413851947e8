"""Auxiliary-loss-free balancing (DeepSeek-V3): the expert bias is train state, not a
parameter; the step moves it by ``rate * sign(mean load - load)`` from the step's global
routed counts, which moves the load towards balance; checkpoints keep it.

One run shared by the tests: six steps on one batch at a learning rate of 1e-9, so that
the routing changes through the bias alone.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxmoe.config import Config, ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.checkpoint import RunCheckpoints, check_compatible
from jaxmoe.train.resolved import resolve
from jaxmoe.train.state import init_train_state
from jaxmoe.train.step import build_eval_step, build_train_step
from tests.train.batches import random_batch

STEPS = 6
RATE = 0.02
CONFIG = Config(
    model=ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16, moe_every=1),
    moe=MoEConfig(
        num_experts=8,
        top_k=2,
        capacity_factor=None,
        score_function="sigmoid",
        expert_bias_rate=RATE,
        aux_loss_coef=0.0,
    ),
    parallel=ParallelConfig(data=2, expert=4),
    train=TrainConfig(batch_size=16, steps=STEPS, warmup_steps=1, learning_rate=1e-9),
)
BIAS_PATHS = [
    ("blocks", 0, "ffn", "router", "expert_bias"),
    ("blocks", 1, "ffn", "router", "expert_bias"),
]


def biases(model_state):
    """The expert biases ``[moe_layers, experts]`` in depth order, on the host."""
    return np.stack([np.asarray(_at(model_state, path)) for path in BIAS_PATHS])


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@functools.cache
def run():
    """The initial state, each step's metrics and biases, and the final state."""
    mesh = build_mesh(CONFIG.parallel)
    state = init_train_state(resolve(CONFIG, mesh))
    initial = jax.device_get(state)
    step = build_train_step(resolve(CONFIG, mesh)).jit()
    batch = random_batch(np.random.default_rng(0), CONFIG, mesh)
    history, bias_history = [], []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
        bias_history.append(biases(state.model_state))
    return mesh, batch, initial, history, bias_history, state


def test_the_bias_is_state_beside_the_parameters_not_one_of_them():
    _, _, initial, _, _, _ = run()

    leaves = jax.tree_util.tree_leaves_with_path((initial.params, initial.opt_state))
    assert not [path for path, _ in leaves if "expert_bias" in jax.tree_util.keystr(path)]
    np.testing.assert_array_equal(biases(initial.model_state), np.zeros((2, 8), np.float32))
    assert len(jax.tree.leaves(initial.model_state)) == 2  # one per MoE layer


def test_each_step_moves_the_bias_by_exactly_rate_times_the_sign_of_the_load_gap():
    # No gradient, no Adam, no weight decay: the bias after each step is the sum of the
    # steps' rate * sign(mean - load), in float32, and nothing else.
    _, _, _, history, bias_history, state = run()

    expected = np.zeros((2, 8), np.float32)
    for metrics, bias in zip(history, bias_history, strict=True):
        load = np.asarray(metrics["tokens_per_expert"], np.float32)
        gap = np.sign(load.mean(axis=-1, keepdims=True) - load).astype(np.float32)
        expected = expected + np.float32(RATE) * gap
        np.testing.assert_array_equal(bias, expected)
    assert np.any(expected != 0)
    # Replicated, and the same on every device.
    for path in BIAS_PATHS:
        shards = [np.asarray(s.data) for s in _at(state.model_state, path).addressable_shards]
        assert len(shards) == 8
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])


def test_the_bias_moves_the_load_towards_balance():
    _, _, _, history, _, _ = run()

    def imbalance(metrics):  # per MoE layer: max / mean assignments
        load = np.asarray(metrics["tokens_per_expert"], np.float64)
        return load.max(axis=-1) / load.mean(axis=-1)

    first = imbalance(history[0])
    assert np.all(first > 1.3), first  # the initial router is far from balance
    for metrics in history[-3:]:
        assert np.all(imbalance(metrics) < first - 0.05), (imbalance(metrics), first)


def test_the_eval_step_routes_with_the_state_s_bias():
    mesh, batch, _, _, _, state = run()
    evaluate = build_eval_step(resolve(CONFIG, mesh)).jit()
    params, model_state = state.params, state.model_state

    with_bias = float(evaluate(params, batch, state.placement, model_state))
    zero = jax.tree.map(lambda b: b * 0, model_state)
    without = float(evaluate(params, batch, state.placement, zero))

    assert np.isfinite(with_bias)
    assert with_bias != without


def test_a_checkpoint_restores_the_bias(tmp_path):
    mesh, _, _, _, bias_history, state = run()
    saved = jax.device_get(state)
    with RunCheckpoints(tmp_path, resolve(CONFIG)) as checkpoints:
        checkpoints.save(state)
        checkpoints.wait()
    with RunCheckpoints(tmp_path, resolve(CONFIG, mesh)) as checkpoints:
        restored = checkpoints.restore(STEPS)

    np.testing.assert_array_equal(biases(restored.model_state), bias_history[-1])
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(restored.model_state), saved.model_state
    )


def test_a_checkpoint_without_biases_is_refused_for_a_run_with_them_and_back():
    old = CONFIG.to_dict()
    del old["moe"]["expert_bias_rate"]  # written before the field existed
    old["moe"].update(score_function="softmax")
    with pytest.raises(ConfigError, match=r"holds no expert biases.*0\.0 -> 0\.02"):
        check_compatible(old, CONFIG, step=3)
    without = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, expert_bias_rate=0.0))
    with pytest.raises(ConfigError, match=r"holds expert biases.*0\.02 -> 0\.0"):
        check_compatible(CONFIG.to_dict(), without, step=3)
    faster = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, expert_bias_rate=0.1))
    assert check_compatible(CONFIG.to_dict(), faster, step=3) == ["moe.expert_bias_rate"]
