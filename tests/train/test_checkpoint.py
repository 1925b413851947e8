"""Checkpoints: exact resume, restore into another layout, refusal of another shape."""

import dataclasses
import json
import shutil

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxmoe.config import Config, ConfigError, DataConfig, DataSource, ParallelConfig
from jaxmoe.data.batches import load_tokens
from jaxmoe.exit_codes import PREEMPTED as PREEMPTED_EXIT_CODE
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.prepare import prepare_run
from jaxmoe.train import loop
from jaxmoe.train.checkpoint import (
    RunCheckpoints,
    check_compatible,
    latest_checkpoint,
    newest_described,
    saved_run,
)
from jaxmoe.train.logs.metrics import read_rows
from jaxmoe.train.resolved import resolve
from jaxmoe.train.run_control import StopSignals
from jaxmoe.train.state import init_train_state
from jaxmoe.train.step import build_train_step

from .batches import random_batch
from .runs import EXACT_KEYS, one_layer_config, small_config


# The mixture's run below stops, resumes and matches the uninterrupted run bit for bit by
# default, and test_run_control.py's SIGTERM run its metrics file row for row: slow.
@pytest.mark.slow
def test_resume_after_a_stop_is_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch):
    config = one_layer_config(steps=6, eval_every=2)
    uninterrupted = loop.train(prepare_run(config), tmp_path / "whole", progress=False)

    # A stop request after 3 steps, as a signal would make (signals: test_run_control.py).
    monkeypatch.setattr(StopSignals, "stop_after", lambda self, done: done == 3)
    with pytest.raises(loop.RunStopped) as stopped:
        loop.train(prepare_run(config), tmp_path / "parts", progress=False)
    assert stopped.value.status == PREEMPTED_EXIT_CODE
    assert latest_checkpoint(tmp_path / "parts") == 3
    monkeypatch.undo()
    resumed = loop.train(prepare_run(config), tmp_path / "parts", progress=False, resume=True)

    assert [row["step"] for row in resumed] == [3, 4, 5]
    pick = lambda rows: [{key: row.get(key) for key in EXACT_KEYS} for row in rows]
    chex.assert_trees_all_equal(pick(stopped.value.rows + resumed), pick(uninterrupted))
    logged = read_rows(tmp_path / "parts" / "metrics.jsonl")
    assert [row["step"] for row in logged] == list(range(6))


def test_a_mixture_resumes_bit_for_bit_and_so_does_a_checkpoint_without_its_position(
    tmp_path, monkeypatch
):
    """Two corpora, 3 : 1 (the default corpus's first 200 kB cut in two): 4 steps, and 2
    steps stopped and resumed from the data position saved with the checkpoint, or from a
    checkpoint written before positions were saved (its run item without one)."""
    text = bytes(load_tokens(None, max_bytes=200_000).astype("u1"))
    (tmp_path / "a.txt").write_bytes(text[:120_000])
    (tmp_path / "b.txt").write_bytes(text[120_000:])
    config = one_layer_config(steps=4, eval_every=2)
    sources = (DataSource(str(tmp_path / "a.txt"), 3.0), DataSource(str(tmp_path / "b.txt")))
    config = dataclasses.replace(config, data=DataConfig(sources=sources))
    uninterrupted = loop.train(prepare_run(config), tmp_path / "whole", progress=False)

    # A stop request after 2 steps, as a signal would make (signals: test_run_control.py).
    monkeypatch.setattr(StopSignals, "stop_after", lambda self, done: done == 2)
    with pytest.raises(loop.RunStopped) as stopped:
        loop.train(prepare_run(config), tmp_path / "parts", progress=False)
    assert stopped.value.status == PREEMPTED_EXIT_CODE
    assert latest_checkpoint(tmp_path / "parts") == 2
    monkeypatch.undo()
    saved = saved_run(tmp_path / "parts", 2)
    assert saved["data"]["next_example"] == 2 * config.train.batch_size
    shutil.copytree(tmp_path / "parts", tmp_path / "old")
    old_run = tmp_path / "old" / "checkpoints" / "2" / "run" / "metadata"
    old_run.write_text(json.dumps({**saved, "data": {"seed": 0, "next_batch": 2}}))

    pick = lambda rows: [{key: row.get(key) for key in EXACT_KEYS} for row in rows]
    for out in ("parts", "old"):
        resumed = loop.train(prepare_run(config), tmp_path / out, progress=False, resume=True)
        assert [row["step"] for row in resumed] == [2, 3]
        chex.assert_trees_all_equal(pick(stopped.value.rows + resumed), pick(uninterrupted))
        logged = read_rows(tmp_path / out / "metrics.jsonl")
        assert [row["step"] for row in logged] == list(range(4))


def _state_on(config: Config):
    mesh = build_mesh(config.parallel)
    return mesh, init_train_state(resolve(config, mesh))


@pytest.mark.parametrize(
    "layout",
    [
        (2, 4),
        pytest.param((4, 2), marks=pytest.mark.slow),
        pytest.param((8, 1), marks=pytest.mark.slow),
    ],
)
def test_restore_into_another_layout_gives_the_saved_values(tmp_path, layout):
    saved_config = one_layer_config(steps=2)  # its step is the resume test's
    mesh, state = _state_on(saved_config)
    # Train one step, so that the optimizer moments are not zeros.
    step = build_train_step(resolve(saved_config, mesh)).jit()
    rng = np.random.default_rng(0)
    state, _ = step(state, random_batch(rng, saved_config, mesh))
    expected = jax.device_get(state)
    with RunCheckpoints(tmp_path, resolve(saved_config)) as checkpoints:
        assert checkpoints.save(state) == 1
        checkpoints.wait()

    data, expert = layout
    config = dataclasses.replace(saved_config, parallel=ParallelConfig(data=data, expert=expert))
    new_mesh = build_mesh(config.parallel)
    with RunCheckpoints(tmp_path, resolve(config, new_mesh)) as checkpoints:
        restored = checkpoints.restore(1)
    chex.assert_trees_all_equal(jax.device_get(restored), expected)
    expert_weight = restored.params["blocks"][0]["ffn"]["experts"]["w_in"]
    assert expert_weight.sharding.mesh.shape == {"data": data, "expert": expert}
    # And the restored state trains in the new layout.
    new_step = build_train_step(resolve(config, new_mesh)).jit()
    _, metrics = new_step(restored, random_batch(rng, config, new_mesh))
    assert np.isfinite(metrics["loss"])


# Routing groups of 8 positions lie inside one device's half of a 16-position row under
# tensor=2 too; groups of whole rows are gathered over the context group; either way both
# layouts route (and drop) the same tokens.
SPLIT_SEQUENCES = {
    "tensor2": (ParallelConfig(data=1, expert=8, tensor=2), 8),
    "context2-tensor2": (ParallelConfig(data=2, expert=4, context=2, tensor=2), None),
}


# The context-parallel layout restores as the tensor-parallel one does (the same state,
# other shardings): the slow tier.
@pytest.mark.parametrize(
    "layout", ["tensor2", pytest.param("context2-tensor2", marks=pytest.mark.slow)]
)
def test_a_checkpoint_without_split_sequences_restores_and_trains_with_them(tmp_path, layout):
    parallel, group_size = SPLIT_SEQUENCES[layout]
    saved_config = one_layer_config(steps=2)
    saved_config = dataclasses.replace(
        saved_config, moe=dataclasses.replace(saved_config.moe, group_size=group_size)
    )
    mesh, state = _state_on(saved_config)
    step = build_train_step(resolve(saved_config, mesh)).jit()
    rng = np.random.default_rng(0)
    state, _ = step(state, random_batch(rng, saved_config, mesh))
    with RunCheckpoints(tmp_path, resolve(saved_config)) as checkpoints:
        checkpoints.save(state)
        checkpoints.wait()
    saved = jax.device_get(state)  # the next step donates the state
    next_rows = rng.integers(
        0, 256, (saved_config.train.batch_size, saved_config.model.seq_len + 1)
    ).astype(np.int32)
    _, expected = step(state, jax.device_put(next_rows, NamedSharding(mesh, token_spec(mesh))))

    config = dataclasses.replace(saved_config, parallel=parallel)
    new_mesh = build_mesh(config.parallel)
    with RunCheckpoints(tmp_path, resolve(config, new_mesh)) as checkpoints:
        restored = checkpoints.restore(1)
    chex.assert_trees_all_equal(jax.device_get(restored), saved)
    query = restored.params["blocks"][0]["attention"]["query"]["kernel"]
    assert tuple(query.sharding.spec) == (None, "tensor_expert")
    new_step = build_train_step(resolve(config, new_mesh)).jit()
    _, metrics = new_step(
        restored, jax.device_put(next_rows, NamedSharding(new_mesh, token_spec(new_mesh)))
    )
    np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=1e-6)
    np.testing.assert_array_equal(metrics["tokens_per_expert"], expected["tokens_per_expert"])


def test_a_checkpoint_of_another_shape_is_refused():
    saved = small_config().to_dict()
    wider = dataclasses.replace(
        small_config(), model=dataclasses.replace(small_config().model, d_model=128)
    )
    with pytest.raises(ConfigError, match=r"model.d_model 64 -> 128.*--overwrite"):
        check_compatible(saved, wider, step=7)
    more_experts = dataclasses.replace(
        small_config(), moe=dataclasses.replace(small_config().moe, num_experts=16)
    )
    with pytest.raises(ConfigError, match=r"moe\.num_experts 8 -> 16"):
        check_compatible(saved, more_experts, step=7)
    # Arrays the model gains: named by the field, not found missing when restoring.
    shared = dataclasses.replace(
        small_config(),
        moe=dataclasses.replace(small_config().moe, num_shared_experts=1, jitter=0.1),
    )
    with pytest.raises(ConfigError, match=r"another shape \(moe\.num_shared_experts 0 -> 1\)"):
        check_compatible(saved, shared, step=7)
    other_layout = dataclasses.replace(small_config(), parallel=ParallelConfig(data=2, expert=4))
    assert check_compatible(saved, other_layout, step=7) == ["parallel.data", "parallel.expert"]
    other_sync = small_config(grad_sync="delayed")
    with pytest.raises(ConfigError, match=r"gradient-sync state .*'allreduce' -> 'delayed'"):
        check_compatible(saved, other_sync, step=7)
    int8 = small_config(grad_sync="int8")
    int8_other_layout = dataclasses.replace(int8, parallel=ParallelConfig(data=2, expert=4))
    with pytest.raises(ConfigError, match=r"parallel\.data 1 -> 2"):
        check_compatible(int8.to_dict(), int8_other_layout, step=7)
    # Its per-device residuals follow each device's block of the parameters.
    int8_tensor = dataclasses.replace(int8, parallel=ParallelConfig(data=1, expert=8, tensor=2))
    with pytest.raises(ConfigError, match=r"parallel\.tensor 1 -> 2"):
        check_compatible(int8.to_dict(), int8_tensor, step=7)
    # A run saved under a research option that left the configuration, at another value
    # than the library's, does not resume as if it had been the library's.
    saved["moe"]["replica_split"] = "round_robin"
    with pytest.raises(ConfigError, match=r"step 7 was written under moe\.replica_split="):
        check_compatible(saved, small_config(), step=7)
    saved["moe"]["replica_split"] = "balanced"
    assert check_compatible(saved, small_config(), step=7) == []


def test_a_checkpoint_restores_under_another_compute_dtype_and_recomputation(tmp_path):
    saved_config = one_layer_config()
    mesh, state = _state_on(saved_config)
    expected = jax.device_get(state)
    with RunCheckpoints(tmp_path, resolve(saved_config)) as checkpoints:
        checkpoints.save(state)
        checkpoints.wait()
    model = dataclasses.replace(saved_config.model, dtype="bfloat16", recompute="layer")
    config = dataclasses.replace(saved_config, model=model)
    changed = check_compatible(saved_config.to_dict(), config, step=0)
    assert changed == ["model.dtype", "model.recompute"]
    with RunCheckpoints(tmp_path, resolve(config, mesh)) as checkpoints:
        chex.assert_trees_all_equal(jax.device_get(checkpoints.restore(0)), expected)


def test_the_newest_checkpoint_is_the_newest_with_its_tree_metadata(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / "checkpoints" / str(step) / "state").mkdir(parents=True)
    for step in (2, 4):
        (tmp_path / "checkpoints" / str(step) / "state" / "_METADATA").write_text("{}")
    assert latest_checkpoint(tmp_path) == 6
    assert newest_described(tmp_path) == 4


def test_only_the_last_checkpoints_are_kept(tmp_path):
    config = one_layer_config(steps=5, checkpoint_every=1, keep_checkpoints=2)
    loop.train(prepare_run(config), tmp_path, progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "5"]
