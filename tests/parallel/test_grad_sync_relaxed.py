"""The relaxed algorithms' mechanisms on their own: decentralized parameter averaging (exact
and 8-bit) and delayed averaging's compensation of its stale gradient.

Each runs the algorithm's per-device code under a ``shard_map`` over fake devices, with a
different value on every device for parameters declared replicated: the situation of
replicas that keep parameters of their own.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxmoe.parallel.grad_sync.decentralized import Decentralized
from jaxmoe.parallel.grad_sync.decentralized_int8 import DecentralizedInt8
from jaxmoe.parallel.grad_sync.delayed import Delayed
from jaxmoe.parallel.grad_sync.quantize import dequantize, quantize
from jaxmoe.parallel.grad_sync.workers import worker_gradients
from jaxmoe.parallel.mesh import DATA_AXIS, EXPERT_AXIS

P = PartitionSpec
AXES = (DATA_AXIS, EXPERT_AXIS)


def per_device(fn, data: int, expert: int):
    """``fn`` on each device of a (data, expert) mesh; every argument and result is stacked
    on a leading axis of one entry per device, in mesh order."""
    mesh = Mesh(np.asarray(jax.devices()[: data * expert]).reshape(data, expert), AXES)
    unstack = lambda tree: jax.tree.map(lambda x: x[0], tree)
    stack = lambda tree: jax.tree.map(lambda x: x[None], tree)
    mapped = jax.shard_map(
        lambda *args: stack(fn(*map(unstack, args))),
        mesh=mesh,
        in_specs=P(AXES),
        out_specs=P(AXES),
        check_vma=False,
    )
    return jax.jit(mapped)


def mixed_by(sync, params, specs, data: int, expert: int):
    axes = {DATA_AXIS: data, EXPERT_AXIS: expert}
    step = jnp.zeros((), jnp.int32)
    after = per_device(lambda p: sync.after_update(p, step, specs, axes), data, expert)
    return jax.device_get(after(params))


def test_decentralized_averages_each_parameter_over_its_replicas():
    """On data 2 x expert 4: a dense parameter has a replica on each of the 8 devices (a
    ring: the mean of itself and its two neighbours); an expert's has one on each data row
    (a pair: the two end with their average)."""
    rng = np.random.default_rng(0)
    params = {
        "dense": rng.normal(size=(8, 3, 5)).astype(np.float32),
        "experts": rng.normal(size=(8, 1, 7)).astype(np.float32),  # one expert per device
    }
    specs = {"dense": P(), "experts": P(EXPERT_AXIS)}
    mixed = mixed_by(Decentralized(bucket_bytes=64), params, specs, 2, 4)

    dense = params["dense"]
    ring = (np.roll(dense, 1, axis=0) + dense + np.roll(dense, -1, axis=0)) / 3
    np.testing.assert_allclose(mixed["dense"], ring, rtol=1e-6, atol=1e-6)
    experts = params["experts"].reshape(2, 4, 1, 7)  # (data, expert, ...)
    pair = np.broadcast_to(experts.mean(axis=0), experts.shape).reshape(8, 1, 7)
    np.testing.assert_allclose(mixed["experts"], pair, rtol=1e-6, atol=1e-6)
    # Doubly stochastic: the mean over replicas does not move.
    np.testing.assert_allclose(mixed["dense"].mean(axis=0), dense.mean(axis=0), atol=1e-6)


def test_repeated_ring_mixing_reaches_the_mean():
    """Mixing alone contracts the replicas' distance to their mean by |lambda_2| = 0.80 per
    step on a ring of 8 (and leaves the mean where it is)."""
    values = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    sync, specs = Decentralized(), P()
    axes = {DATA_AXIS: 8, EXPERT_AXIS: 1}
    after = per_device(lambda p: sync.after_update(p, jnp.int32(0), specs, axes), 8, 1)
    mixed = jnp.asarray(values)
    spread = [np.abs(values - values.mean(axis=0)).max()]
    for _ in range(20):
        mixed = after(mixed)
        spread.append(np.abs(np.asarray(mixed) - values.mean(axis=0)).max())
    lambda_2 = (1 + 2 * np.cos(2 * np.pi / 8)) / 3
    assert spread[-1] <= spread[0] * lambda_2**20 * 1.5 + 1e-6
    assert spread[-1] < 0.02 * spread[0]


def test_int8_gossip_pulls_two_replicas_to_within_half_a_step_of_their_average():
    """The peer's decoded codes minus one's own: a pair lands within half a quantisation
    step of its mean, its sum unchanged; each parameter is quantised in chunks of its own,
    so a small parameter bucketed beside a large one keeps its own, finer, step."""
    rng = np.random.default_rng(2)
    chunk = 64
    params = {
        "large": rng.normal(size=(2, 300)).astype(np.float32),
        "small": 1e-3 * rng.normal(size=(2, 100)).astype(np.float32),
    }
    specs = {"large": P(), "small": P()}
    mixed = mixed_by(DecentralizedInt8(bucket_bytes=1 << 20, chunk=chunk), params, specs, 2, 1)
    for name, values in params.items():
        step = max(float(quantize(v, chunk).step.max()) for v in values)
        got = mixed[name]
        np.testing.assert_allclose(got.sum(axis=0), values.sum(axis=0), rtol=1e-6, atol=1e-6)
        assert np.abs(got - values.mean(axis=0)).max() <= step / 2 * 1.001 + 1e-7, name
        assert np.abs(values - values.mean(axis=0)).max() > 10 * step  # they did move
    # The small parameter's own step: a thousandth of what a chunk shared with the large
    # one would give.
    assert np.abs(mixed["small"] - params["small"].mean(axis=0)).max() < 1e-4


def test_int8_gossip_leaves_agreeing_replicas_as_they_are():
    """Replicas that agree send identical codes and do not move, on a ring of 8; gossip of
    the decoded values themselves would move them by the quantisation error."""
    chunk = 64
    shared = np.random.default_rng(3).normal(size=(200,)).astype(np.float32)
    params = np.broadcast_to(shared, (8, 200)).copy()
    mixed = mixed_by(DecentralizedInt8(chunk=chunk), params, P(), 8, 1)
    chex.assert_trees_all_equal(mixed, params)
    decoded = dequantize(quantize(jnp.asarray(shared), chunk), shared.shape, jnp.float32)
    assert np.abs((shared + 2 * decoded) / 3 - shared).max() > 1e-4  # the control moves


def test_int8_gossip_keeps_the_mean_on_a_ring():
    values = np.random.default_rng(4).normal(size=(8, 500)).astype(np.float32)
    mixed = mixed_by(DecentralizedInt8(chunk=128), values, P(), 8, 1)
    np.testing.assert_allclose(mixed.mean(axis=0), values.mean(axis=0), atol=1e-6)
    exact = (np.roll(values, 1, axis=0) + values + np.roll(values, -1, axis=0)) / 3
    # Off exact gossip by the quantisation errors: 4 half steps / 3 at most.
    step = max(float(quantize(jnp.asarray(row), 128).step.max()) for row in values)
    assert np.abs(mixed - exact).max() <= 2 / 3 * step * 1.001


def test_a_workers_gradient_is_its_own_rows_and_exact_inside_its_host():
    """Per device, each device's gradient of its loss / 8 shards. Every device a worker: a
    replicated parameter's gradient times the 8 workers holding it, an expert's (replicated
    over data only) times 2. Hosts of 4 (a data row each): summed inside the host, times
    the 2 hosts."""
    mesh_axes = {DATA_AXIS: 2, EXPERT_AXIS: 4}
    rng = np.random.default_rng(6)
    grads = {
        "dense": rng.normal(size=(8, 3)).astype(np.float32),
        "experts": rng.normal(size=(8, 1, 3)).astype(np.float32),
    }
    specs = {"dense": P(), "experts": P(EXPERT_AXIS)}
    for per_host in (1, 4):
        own_of = lambda g, per_host=per_host: worker_gradients(
            g, specs, mesh_axes, per_host, 1 << 20
        )
        own = per_device(own_of, 2, 4)(grads)
        dense = grads["dense"]
        if per_host == 4:
            dense = np.repeat(dense.reshape(2, 4, 3).sum(axis=1), 4, axis=0)
        scale = 8 if per_host == 1 else 2
        np.testing.assert_allclose(own["dense"], scale * dense, rtol=1e-6)
        np.testing.assert_allclose(own["experts"], 2 * grads["experts"], rtol=1e-6)


def test_hosts_exchange_shares_and_end_with_the_pair_average():
    """Hosts of 4 on data 2 x expert 4: a dense parameter is the same on a host's 4
    devices; each sends a quarter to its counterpart on the other host, and every device
    ends with the two hosts' mean. Expert parameters pair across hosts whole."""
    rng = np.random.default_rng(7)
    hosts = rng.normal(size=(2, 1, 37)).astype(np.float32)  # not a multiple of 4
    params = {
        "dense": np.repeat(hosts, 4, axis=0),
        "experts": rng.normal(size=(8, 1, 5)).astype(np.float32),
    }
    specs = {"dense": P(), "experts": P(EXPERT_AXIS)}
    mixed = mixed_by(Decentralized(bucket_bytes=1 << 20, devices_per_host=4), params, specs, 2, 4)
    np.testing.assert_allclose(
        mixed["dense"], np.broadcast_to(hosts.mean(axis=0), (8, 1, 37)), rtol=1e-6
    )
    experts = params["experts"].reshape(2, 4, 1, 5)
    pair = np.broadcast_to(experts.mean(axis=0), experts.shape).reshape(8, 1, 5)
    np.testing.assert_allclose(mixed["experts"], pair, rtol=1e-6)
    # One host: nothing crosses, nothing moves.
    alone = mixed_by(Decentralized(devices_per_host=8), params, specs, 2, 4)
    chex.assert_trees_all_equal(alone, params)


def test_delayed_workers_resynchronise_a_slice_of_their_parameters_each_step():
    """Hosts of 4 on data 2 x expert 4, resync_every 4: each step averages one quarter of
    each bucket across the two hosts and leaves the rest; after 4 steps the hosts agree."""
    rng = np.random.default_rng(8)
    hosts = rng.normal(size=(2, 1, 50)).astype(np.float32)
    params = {"dense": np.repeat(hosts, 4, axis=0)}
    specs = {"dense": P()}
    mesh_axes = {DATA_AXIS: 2, EXPERT_AXIS: 4}
    sync = Delayed(bucket_bytes=1 << 20, devices_per_host=4, resync_every=4)
    after = per_device(lambda p, s: sync.after_update(p, s[0], specs, mesh_axes), 2, 4)
    mean = hosts.mean(axis=0)
    values = params
    for step in range(4):
        values = after(values, np.full((8, 1), step, np.int32))
        got = np.asarray(values["dense"])
        # Each device of a host holds a quarter share of 13 (50 padded to 52); each share
        # averages its slice of 4 (13 padded to 16) at this step.
        for share in range(4):
            averaged = np.zeros(50, bool)
            for done in range(step + 1):
                averaged[share * 13 + done * 4 : share * 13 + min(done * 4 + 4, 13)] = True
            averaged &= np.arange(50) < min(50, share * 13 + 13)
            np.testing.assert_allclose(
                got[:, 0, averaged],
                np.broadcast_to(mean[0, averaged], (8, averaged.sum())),
                rtol=1e-6,
            )
            kept = ~averaged & (np.arange(50) >= share * 13) & (np.arange(50) < share * 13 + 13)
            np.testing.assert_array_equal(
                got[:4, 0, kept], np.broadcast_to(hosts[0, 0, kept], (4, kept.sum()))
            )
    np.testing.assert_allclose(got, np.broadcast_to(mean, (8, 1, 50)), rtol=1e-6)


def test_delayed_averaging_keeps_the_mean_on_the_synchronous_path():
    """Gradient descent on a quadratic whose minimum differs per worker (4 workers):
    applying the one-step-stale average alone leaves the synchronous path; with each
    worker's own fresh gradient standing in for it (and corrected a step later), the mean
    over workers follows the synchronous iterates exactly, while the workers themselves
    differ."""
    workers, size, lr, steps = 4, 16, 0.5, 12
    rng = np.random.default_rng(5)
    curvature = np.linspace(0.1, 1.0, size).astype(np.float32)
    centres = rng.normal(size=(workers, size)).astype(np.float32)
    mesh_axes = {DATA_AXIS: workers, EXPERT_AXIS: 1}
    sync, spec = Delayed(), {"x": P()}

    def step(x, centre, pending, local):
        # Each device's gradient of its loss / shards, as the train step hands it over.
        grads = {"x": curvature * (x - centre) / workers}
        state = {"pending": {"x": pending}, "local": {"x": local[None]}}
        out = sync(grads, state, spec, mesh_axes)
        return x - lr * out.grads["x"], out.state["pending"]["x"], out.state["local"]["x"][0]

    run = per_device(step, workers, 1)
    x = np.zeros((workers, size), np.float32)
    pending, local = np.zeros_like(x), np.zeros_like(x)
    synchronous = stale = np.zeros(size)
    stale_pending, stale_off = np.zeros(size), 0.0
    for _ in range(steps):
        x, pending, local = map(np.asarray, run(x, centres, pending, local))
        gradient = lambda point: (curvature * (point - centres)).mean(axis=0)
        synchronous = synchronous - lr * gradient(synchronous)
        stale, stale_pending = stale - lr * stale_pending, gradient(stale)
        stale_off = max(stale_off, np.abs(stale - synchronous).max())
        np.testing.assert_allclose(x.mean(axis=0), synchronous, rtol=1e-5, atol=1e-6)
        # The pending average is the same on every worker.
        chex.assert_trees_all_equal(*pending)
    assert stale_off > 0.1  # the uncompensated control leaves the path
    assert np.abs(x - x.mean(axis=0)).max() > 1e-3  # the workers do differ
