"""``train.grad_sync`` in the whole train step: exactness and convergence.

``allreduce`` is today's step, ``bucketed`` equals it bit for bit, and the
relaxed algorithms train within a stated margin of it. One compiled step per
algorithm, shared by the tests through a module-scoped cache; the runs compared with
allreduce step for step take its first 8 steps, the relaxed ones all 20. The config is
``small_config`` cut to one (MoE) layer to keep compiles short, on a (2, 4)
mesh so that dense gradients are reduced over 8 devices and expert gradients
over 2, and the data are counting sequences (random start, stride 1-3): a
task the model learns fast, so that a broken algorithm shows in the loss.
"""

import dataclasses

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import Config, ParallelConfig
from jaxmoe.parallel.grad_sync.allreduce import AllReduce
from jaxmoe.parallel.grad_sync.base import GradSync, Synced, local_shape, per_device_specs
from jaxmoe.parallel.grad_sync.bucketed import Bucketed
from jaxmoe.parallel.mesh import build_mesh, mesh_axis_sizes, token_spec
from jaxmoe.parallel.sharding import reduce_gradients
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import abstract_step_args
from jaxmoe.train.state import init_train_state
from jaxmoe.train.step import build_train_step

from .runs import small_config

STEPS = 20
# The runs compared with allreduce's step for step (bucketed, hierarchical, one host) stop
# after this many steps of the same 20-step schedule: their claims hold at every step. The
# relaxed algorithms' convergence is compared over all 20 (int8's residual after them).
COMPARED_STEPS = 8


def config_for(grad_sync: str, **train_fields) -> Config:
    config = small_config(
        grad_sync=grad_sync, steps=STEPS, warmup_steps=2, learning_rate=1e-2, **train_fields
    )
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, num_layers=1, moe_every=1),
        parallel=ParallelConfig(data=2, expert=4),
    )


def counting_batch(rng: np.random.Generator, config: Config, mesh) -> jax.Array:
    rows, length = config.train.batch_size, config.model.seq_len + 1
    start = rng.integers(0, 256, (rows, 1))
    stride = rng.integers(1, 4, (rows, 1))
    tokens = (start + stride * np.arange(length)) % 256
    return jax.device_put(tokens.astype(np.int32), NamedSharding(mesh, token_spec(mesh)))


def train(config: Config, steps: int):
    """Metrics of the first ``steps`` steps of the run; the state after COMPARED_STEPS steps
    and after the last (``{steps done: state}``)."""
    mesh = build_mesh(config.parallel)
    state = init_train_state(resolve(config, mesh))
    step = build_train_step(resolve(config, mesh)).jit()
    rng = np.random.default_rng(0)
    history, states = [], {}
    for index in range(steps):
        state, metrics = step(state, counting_batch(rng, config, mesh))
        history.append(jax.device_get(metrics))
        if index + 1 in (COMPARED_STEPS, steps):
            states[index + 1] = jax.device_get(state)
    return history, states


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def run(name: str, steps: int = STEPS, **train_fields):
        key = (name, steps, tuple(sorted(train_fields.items())))
        if key not in cache:
            cache[key] = train(config_for(name, **train_fields), steps)
        return cache[key]

    return run


def test_allreduce_is_the_reduce_gradients_step():
    """The same per-device program as a step that calls ``reduce_gradients`` directly (what
    the step did before ``grad_sync``): equal jaxprs compile to equal results."""
    config = config_for("allreduce")
    mesh = build_mesh(config.parallel)
    run = resolve(config, mesh)
    example = abstract_step_args(run)

    def per_device_jaxpr(run) -> str:
        return str(jax.make_jaxpr(build_train_step(run).jit())(*example))

    class ReduceGradients(GradSync):
        def __call__(self, grads, state, specs, mesh_axes):
            return Synced(reduce_gradients(grads, specs), state)

    assert per_device_jaxpr(dataclasses.replace(run, grad_sync=ReduceGradients())) == (
        per_device_jaxpr(run)
    )


def test_bucketed_reduces_gradients_bit_for_bit_like_allreduce():
    """Random gradients shaped like the model's, with its specs, on the (2, 4) mesh."""
    config = config_for("allreduce")
    mesh = build_mesh(config.parallel)
    axes = mesh_axis_sizes(config.parallel)
    resolved = resolve(config)
    _, specs = resolved.graphdef, resolved.model_specs
    shapes = resolve(config).state_shapes.params
    rng = np.random.default_rng(0)
    # One block per device of a per-device array: (8, *local shape).
    grads = jax.tree.map(
        lambda shape, spec: rng.normal(size=(8, *local_shape(shape.shape, spec, axes))).astype(
            np.float32
        ),
        shapes,
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )

    def reduced_by(sync):
        per_device = lambda g: sync(jax.tree.map(lambda x: x[0], g), {}, specs, axes).grads
        mapped = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(per_device_specs(specs, axes),),
            out_specs=specs,
            check_vma=False,
        )
        placed = jax.device_put(grads, NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
        return jax.device_get(jax.jit(mapped)(placed))

    # 16 KiB buckets: several for the dense gradients (about 180 kB).
    chex.assert_trees_all_equal(reduced_by(Bucketed(16 * 1024)), reduced_by(AllReduce()))


def test_bucketed_step_equals_allreduce_within_ulps(runs):
    """Within a few ulps, not bitwise: see ``grad_sync/bucketed.py``."""
    bucketed_history, bucketed_states = runs(
        "bucketed", COMPARED_STEPS, grad_bucket_bytes=16 * 1024
    )
    history, states = runs("allreduce")
    chex.assert_trees_all_equal(bucketed_history[0], history[0])
    for name in ("loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[name] for m in bucketed_history],
            [m[name] for m in history[:COMPARED_STEPS]],
            rtol=1e-6,
        )
    # Adam divides by sqrt(v): an ulp in a tiny gradient moves its parameter by a fraction
    # of one step (lr = 1e-2), hence the absolute tolerance.
    chex.assert_trees_all_close(
        bucketed_states[COMPARED_STEPS].params, states[COMPARED_STEPS].params, rtol=1e-4, atol=1e-4
    )


def losses(history) -> np.ndarray:
    return np.asarray([float(metrics["loss"]) for metrics in history])


def test_hierarchical_step_equals_allreduce_within_float_tolerance(runs):
    """Hosts of 4 devices: dense gradients reduce-scatter in the host, cross hosts as a
    quarter, gather back; the sums are grouped differently, hence a tolerance."""
    hierarchical_history, hierarchical_states = runs(
        "hierarchical", COMPARED_STEPS, grad_sync_devices_per_host=4
    )
    history, states = runs("allreduce")
    for name in ("loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[name] for m in hierarchical_history],
            [m[name] for m in history[:COMPARED_STEPS]],
            rtol=1e-5,
        )
    chex.assert_trees_all_close(
        hierarchical_states[COMPARED_STEPS].params,
        states[COMPARED_STEPS].params,
        rtol=1e-3,
        atol=1e-3,
    )


# Hosts of 4 devices (the emulated cluster's, one data row each) for the relaxed algorithms:
# inside a host they are exact, across hosts relaxed (grad_sync/workers.py).
HOSTS = {"grad_sync_devices_per_host": 4}
# Final loss (mean of the last 3 steps) may exceed allreduce's by at most this much.
# Measured: allreduce 1.888; int8 1.888; decentralized 2.090 and decentralized-int8 2.086
# (each host's AdamW steps on half the batch); delayed 2.210 (the compensation's fresh
# local gradients inflate AdamW's second moment), at this high learning rate.
# Broken controls measured on the same run: hosts that never mix their parameters end 0.52
# above; a delayed step whose average never arrives (zeros) ends 2.05 above.
MARGINS = {"int8": 0.05, "decentralized": 0.4, "decentralized-int8": 0.4, "delayed": 0.6}


@pytest.mark.parametrize("name", sorted(MARGINS))
def test_relaxed_algorithm_trains_close_to_allreduce(runs, name):
    reference = losses(runs("allreduce")[0])
    relaxed = losses(runs(name, **HOSTS)[0])
    assert reference[-3:].mean() < reference[0] - 3  # the task is learned
    assert relaxed[-3:].mean() <= reference[-3:].mean() + MARGINS[name], relaxed


# On one host both reduce with worker_gradients over the host's 8 devices, which delayed
# applies at once; decentralized's mixing of one host is the identity in
# tests/parallel/test_grad_sync_relaxed.py: its case is slow.
@pytest.mark.parametrize("name", [pytest.param("decentralized", marks=pytest.mark.slow), "delayed"])
def test_on_one_host_nothing_is_relaxed(runs, name):
    """One host (the default in one process): the workers' gradients are summed exactly,
    nothing is mixed or delayed, and the run is allreduce's."""
    history, states = runs(name, COMPARED_STEPS, grad_sync_devices_per_host=8)
    reference, reference_states = runs("allreduce")
    for metric in ("loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[metric] for m in history],
            [m[metric] for m in reference[:COMPARED_STEPS]],
            rtol=1e-6,
        )
    chex.assert_trees_all_close(
        states[COMPARED_STEPS].params, reference_states[COMPARED_STEPS].params, atol=1e-6
    )


def test_int8_keeps_a_residual_per_device(runs):
    # The run of the convergence test above: hosts of 4 devices, one copy of each expert
    # per host, so every device quantises its whole expert gradient.
    _, states = runs("int8", **HOSTS)
    residual = states[STEPS].grad_sync["residual"]
    w_in = residual["blocks"][0]["ffn"]["experts"]["w_in"]
    # One block per device: (8 devices, 8 experts / 4, 64, 512).
    assert w_in.shape == (8, 2, 64, 512)
    assert np.abs(w_in).max() > 0
    # Residuals differ between devices (each quantised its own gradient).
    assert not np.array_equal(w_in[0], w_in[1])


def test_decentralized_int8_trains_like_decentralized(runs):
    """Gossip of 8-bit codes ends where exact gossip does (measured: within 0.004)."""
    exact = losses(runs("decentralized", **HOSTS)[0])
    quantised = losses(runs("decentralized-int8", **HOSTS)[0])
    assert abs(quantised[-3:].mean() - exact[-3:].mean()) <= 0.05, quantised
