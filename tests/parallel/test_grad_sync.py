"""The gradient-sync building blocks on their own: quantiser, error feedback, buckets, hosts
(the relaxed algorithms' mixing and compensation: test_grad_sync_relaxed.py)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from jaxmoe.config import (
    Config,
    ConfigError,
    ParallelConfig,
    TrainConfig,
)
from jaxmoe.config.choices import GRAD_SYNC_CHOICES, GRAD_SYNCS
from jaxmoe.parallel.grad_sync import ALGORITHMS, make_grad_sync
from jaxmoe.parallel.grad_sync.bucketed import plan_buckets
from jaxmoe.parallel.grad_sync.hierarchical import devices_per_host, hierarchical_sum, host_groups
from jaxmoe.parallel.grad_sync.int8 import Int8, hierarchical_quantized_sum, quantized_sum
from jaxmoe.parallel.grad_sync.quantize import LEVELS, dequantize, quantize
from jaxmoe.parallel.mesh import DATA_AXIS, EXPERT_AXIS, build_mesh

MESH_AXES = (DATA_AXIS, EXPERT_AXIS)

P = PartitionSpec


def test_config_names_every_algorithm():
    assert GRAD_SYNCS == ALGORITHMS
    assert (*ALGORITHMS, "auto") == GRAD_SYNC_CHOICES
    for name in ALGORITHMS:
        make_grad_sync(TrainConfig(grad_sync=name))
    with pytest.raises(ValueError, match="resolved first"):
        make_grad_sync(TrainConfig(grad_sync="auto"))
    with pytest.raises(ConfigError, match=r"train\.grad_sync='ring'"):
        TrainConfig(grad_sync="ring")
    with pytest.raises(ConfigError, match=r"train\.grad_bucket_bytes"):
        TrainConfig(grad_bucket_bytes=0)
    with pytest.raises(ConfigError, match=r"train\.grad_sync_devices_per_host=-1"):
        TrainConfig(grad_sync_devices_per_host=-1)
    with pytest.raises(ConfigError, match=r"grad_sync_devices_per_host=3 does not divide"):
        Config(train=TrainConfig(grad_sync_devices_per_host=3))


def test_hosts_cut_replica_groups_into_in_host_and_cross_host_groups():
    axes = {"data": 2, "expert": 4}
    # Dense gradients (replicated everywhere), hosts of 4: one row of the mesh each.
    inside, across = host_groups(("data", "expert"), axes, 4)
    assert inside == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert across == ((0, 4), (1, 5), (2, 6), (3, 7))
    # Expert gradients (replicated over data): one member per host, nothing in-host.
    assert host_groups(("data",), axes, 4) == (((0,), (1,)), ((0, 1),))
    # Hosts of 2 split each expert group in two.
    inside, _ = host_groups(("expert",), axes, 2)
    assert inside == ((0, 1), (2, 3))
    # Hosts of 4 over expert groups of 6 leave groups of 4 and 2 members: refused.
    with pytest.raises(ConfigError, match="grad_sync_devices_per_host=4"):
        host_groups(("expert",), {"data": 2, "expert": 6}, 4)


def test_devices_per_host_follows_the_processes():
    mesh = build_mesh(ParallelConfig(data=2, expert=4))
    assert devices_per_host(4, mesh) == 4
    assert devices_per_host(0, mesh) == 8  # one process: one host


def test_hierarchical_sum_is_the_sum_and_crosses_hosts_with_a_quarter():
    """Within float tolerance of the plain sum, the same on every device; the cross-host
    reduction carries 1/4 of the bucket (hosts of 4)."""
    values = jnp.asarray(np.random.default_rng(2).normal(size=(8, 1001)), jnp.float32)
    inside, across = host_groups(("data",), {"data": 8, "expert": 1}, 4)
    summed = on_mesh(lambda v: hierarchical_sum(v, ("data",), inside, across), 8)
    got = np.asarray(summed(values))
    np.testing.assert_allclose(
        got, np.broadcast_to(values.sum(axis=0), got.shape), rtol=1e-5, atol=1e-5
    )
    chex.assert_trees_all_equal(*got)  # every replica applies the same sum
    cross = [
        eqn
        for eqn in all_eqns(jax.make_jaxpr(summed)(values).jaxpr)
        if eqn.primitive.name == "psum"
    ]
    assert [eqn.params["axis_index_groups"] for eqn in cross] == [across]
    assert cross[0].invars[0].aval.shape == (1004 // 4,)  # padded to a multiple of 4


def test_quantiser_error_is_at_most_half_a_step():
    x = jax.random.normal(jax.random.key(0), (37, 101)) * jnp.linspace(0.01, 10, 101)
    q = quantize(x, chunk=256)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (15, 256)
    decoded = dequantize(q, x.shape, x.dtype)
    flat_error = jnp.abs(decoded - x).ravel()
    flat_error = jnp.pad(flat_error, (0, -flat_error.size % 256)).reshape(-1, 256)
    # Half a step, and float rounding of values up to |10 * 4|.
    assert bool(jnp.all(flat_error <= q.step / 2 + 1e-5))
    flat = np.asarray(x).ravel()
    ranges = np.ptp(np.pad(flat, (0, -flat.size % 256), mode="edge").reshape(-1, 256), axis=1)
    np.testing.assert_allclose(np.asarray(q.step)[:, 0], ranges / LEVELS, rtol=1e-6)


def test_quantiser_is_exact_on_constant_chunks():
    x = jnp.concatenate([jnp.full((64,), 0.123), jnp.full((64,), -7.5), jnp.zeros((64,))])
    q = quantize(x, chunk=64)
    chex.assert_trees_all_equal(dequantize(q, x.shape, x.dtype), x)


def all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from all_eqns(inner)


def on_mesh(fn, devices: int):
    """``fn`` per device over a (data=devices, expert=1) mesh; arguments and results
    stacked on a leading device axis."""
    mesh = Mesh(np.asarray(jax.devices()[:devices]).reshape(devices, 1), MESH_AXES)
    mapped = jax.shard_map(
        lambda *xs: jax.tree.map(lambda y: y[None], fn(*(x[0] for x in xs))),
        mesh=mesh,
        in_specs=P(MESH_AXES),
        out_specs=P(MESH_AXES),
        check_vma=False,
    )
    return jax.jit(mapped)


def test_int8_error_feedback_carries_the_residual():
    """Summed over steps, the applied gradients trail the exact ones only by the residuals
    still held (at most half a step each); without feedback the quantiser's bias adds up."""
    devices, steps = 2, 30
    rng = np.random.default_rng(0)
    # A fixed per-device gradient whose values fall between quantisation levels.
    grads = jnp.asarray(rng.normal(size=(devices, 300)), jnp.float32)
    spec = {"w": P()}
    results = {}
    for feedback in (True, False):
        sync = Int8(chunk=128, error_feedback=feedback)

        def per_device(grad, residual, sync=sync):
            state = {"residual": {"w": residual[None]}}
            out = sync({"w": grad}, state, spec, {"data": devices, "expert": 1})
            return out.grads["w"], out.state["residual"]["w"][0]

        step = on_mesh(per_device, devices)
        decode = jax.jit(jax.vmap(lambda v: dequantize(quantize(v, 128), v.shape, v.dtype)))
        residual = jnp.zeros_like(grads)
        applied = jnp.zeros_like(grads)
        for _ in range(steps):
            reduced, new_residual = step(grads, residual)
            # The residual is the input minus what was sent (none kept without feedback).
            value = grads + residual if feedback else grads
            sent = decode(value)
            kept = value - sent if feedback else jnp.zeros_like(value)
            np.testing.assert_allclose(new_residual, kept, atol=1e-6)
            np.testing.assert_allclose(reduced[0], sent.sum(axis=0), atol=1e-5)
            chex.assert_trees_all_equal(reduced[0], reduced[1])  # replicas stay identical
            applied, residual = applied + reduced, new_residual
        exact = steps * grads.sum(axis=0)
        results[feedback] = np.abs(np.asarray(applied[0] - exact)).max()
        if feedback:
            np.testing.assert_allclose(applied[0], exact - residual.sum(axis=0), atol=1e-3)
    # With feedback the gap stays within the residuals' bound (half a step per device); without
    # it, the rounding bias grows with every step.
    half_steps = devices * float(jax.vmap(lambda g: quantize(g, 128).step.max())(grads).max()) / 2
    assert results[True] <= half_steps * 1.01
    assert results[False] > 10 * half_steps


def test_int8_adds_the_members_decoded_values_without_a_reduction():
    """The cross-host sum adds the decoded codes member by member: no reduction over the
    gathered axis, which XLA:CPU runs as a kernel tens of times slower than the additions
    (experiments/results/grad_sync_trace_before_int8_sum.md); the sum is unchanged."""
    values = jnp.asarray(np.random.default_rng(5).normal(size=(4, 300)), jnp.float32)
    summed_fn = on_mesh(lambda v: quantized_sum(v, ("data",), 64), 4)
    primitives = {eqn.primitive.name for eqn in all_eqns(jax.make_jaxpr(summed_fn)(values).jaxpr)}
    assert "all_gather" in primitives and "reduce_sum" not in primitives
    summed, _ = summed_fn(values)
    decoded = jax.vmap(lambda v: dequantize(quantize(v, 64), v.shape, v.dtype))(values)
    np.testing.assert_allclose(summed[0], np.asarray(decoded).sum(axis=0), atol=1e-5)
    chex.assert_trees_all_equal(*np.asarray(summed))  # replicas stay identical


def test_buckets_follow_reverse_order_size_and_axes():
    leaves = [jnp.zeros((n,), jnp.float32) for n in (10, 20, 30, 40, 50)]
    axes = [("data", "expert"), ("data",), ("data", "expert"), ("data", "expert"), ()]
    buckets = plan_buckets(leaves, axes, bucket_bytes=4 * 70)
    # Leaf 4 is sharded everywhere (no reduction); leaves 3 and 2 fill a bucket (280 bytes),
    # leaf 0 opens the next; leaf 1 has other axes.
    assert [(b.axes, b.leaves) for b in buckets] == [
        (("data", "expert"), [3, 2]),
        (("data",), [1]),
        (("data", "expert"), [0]),
    ]


def test_int8_quantises_only_the_cross_host_step_and_keeps_the_rest():
    """Hosts of 4: each device quantises the in-host sum of its quarter; what was not sent
    stays in its residual, at that quarter's place, so applied + residuals = exact."""
    values = jnp.asarray(np.random.default_rng(4).normal(size=(8, 301)), jnp.float32)
    inside, across = host_groups(("data",), {"data": 8, "expert": 1}, 4)
    summed, residual = on_mesh(
        lambda v: hierarchical_quantized_sum(v, ("data",), inside, across, 64), 8
    )(values)
    summed, residual, exact = np.asarray(summed), np.asarray(residual), np.asarray(values)
    chex.assert_trees_all_equal(*summed)  # replicas stay identical
    np.testing.assert_allclose(summed[0] + residual.sum(axis=0), exact.sum(axis=0), atol=1e-5)
    assert 0 < np.abs(summed[0] - exact.sum(axis=0)).max() < 0.1  # quantised, not exact
    # Padded to 304, each device holds a shard of 76: its residual lives there only.
    for device in range(8):
        outside = np.ones(301, bool)
        outside[(device % 4) * 76 : (device % 4 + 1) * 76] = False
        assert not residual[device][outside].any()
