"""Mesh construction and the sharding rules derived from parameter types."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ConfigError, MoEConfig, ParallelConfig
from jaxmoe.layers.moe import MoELayer
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.parallel.sharding import global_norm, param_specs, reduce_gradients, replicated_axes


def test_mesh_axes_and_device_order():
    mesh = build_mesh(ParallelConfig(data=2, expert=4))
    assert mesh.axis_names == ("data", "expert")
    assert mesh.devices.shape == (2, 4)
    assert list(mesh.devices.flat) == jax.devices()


def test_mesh_must_cover_every_device():
    with pytest.raises(ConfigError, match="2 x 2 x 1 = 4, but there are 8 devices"):
        build_mesh(ParallelConfig(data=2, expert=2))


def test_expert_weights_are_sharded_and_the_router_replicated():
    layer = MoELayer(8, 16, MoEConfig(num_experts=8), dtype=jnp.float32, rngs=nnx.Rngs(0))
    specs = param_specs(nnx.state(layer))
    assert specs["router"]["kernel"] == PartitionSpec()
    assert {spec for spec in specs["experts"].values()} == {PartitionSpec("expert")}
    assert replicated_axes(PartitionSpec()) == ("data", "expert")
    assert replicated_axes(PartitionSpec("expert")) == ("data",)


def test_gradient_reduction_and_global_norm_on_the_mesh():
    mesh = build_mesh(ParallelConfig(data=2, expert=4))
    specs = {"dense": PartitionSpec(), "expert": PartitionSpec("expert")}
    rng = np.random.default_rng(0)
    dense = rng.normal(size=(8, 3)).astype(np.float32)  # one row per device
    expert = rng.normal(size=(2, 4, 5)).astype(np.float32)  # [data, expert shard, ...]

    def per_device(dense_row, expert_block):
        grads = {"dense": dense_row[0], "expert": expert_block[0]}
        reduced = reduce_gradients(grads, specs)
        return reduced, global_norm(reduced, specs)

    in_specs = (PartitionSpec(("data", "expert")), PartitionSpec("data", "expert"))
    out_specs = ({"dense": PartitionSpec(), "expert": PartitionSpec("expert")}, PartitionSpec())
    step = jax.shard_map(
        per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    inputs = [
        jax.device_put(array, NamedSharding(mesh, spec))
        for array, spec in zip((dense, expert), in_specs, strict=True)
    ]
    reduced, norm = jax.jit(step)(*inputs)
    expected_dense = dense.sum(axis=0)  # summed over every device
    expected_expert = expert.sum(axis=0)  # summed over data, still sharded over expert
    np.testing.assert_allclose(reduced["dense"], expected_dense, rtol=1e-6)
    np.testing.assert_allclose(reduced["expert"], expected_expert.reshape(4, 5), rtol=1e-6)
    expected_norm = np.sqrt((expected_dense**2).sum() + (expected_expert**2).sum())
    np.testing.assert_allclose(norm, expected_norm, rtol=1e-6)
