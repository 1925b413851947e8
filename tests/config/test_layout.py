"""Folding the attention and MoE layouts onto one mesh: axes, roles and refusals."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import Config, ConfigError, ModelConfig, MoEConfig, ParallelConfig
from jaxmoe.config.layout import axes_for_role, mesh_axes
from jaxmoe.parallel.mesh import build_mesh, role_axes, token_spec


def _axes(data, tensor, expert, expert_tensor):
    return [(axis.name, axis.size) for axis in mesh_axes(data, tensor, expert, expert_tensor)]


def test_unfolded_layout_is_the_data_by_expert_mesh():
    assert _axes(2, 1, 4, 1) == [("data", 2), ("expert", 4)]
    assert _axes(1, 1, 8, 1) == [("data", 1), ("expert", 8)]


def test_tensor_folded_into_the_expert_group():
    # 8 devices: attention 4 data x 2 tensor; MoE 2 expert data x 4 experts. The tensor
    # pairs (0,1), (2,3), ... lie inside the expert groups (0..3), (4..7).
    names = ("data", "expert", "tensor_expert")
    assert _axes(2, 2, 4, 1) == list(zip(names, (2, 2, 2), strict=True))
    assert axes_for_role("tensor", names) == ("tensor_expert",)
    assert axes_for_role("expert", names) == ("expert", "tensor_expert")
    assert axes_for_role("data", names) == ("data", "expert")
    assert axes_for_role("expert_data", names) == ("data",)


def test_expert_tensor_and_tensor_aligned():
    # tensor 2 = expert_tensor 2: one axis plays both; experts over 2, replicas over 2.
    assert _axes(2, 2, 2, 2) == [("data", 2), ("expert", 2), ("tensor", 2)]


def test_tensor_wider_than_the_expert_group():
    # tensor 4 spans the expert pair and two expert-data replicas; no axis is attention
    # data and expert at once, so "expert" is a size-1 placeholder (outermost).
    assert _axes(4, 4, 2, 1) == [
        ("expert", 1),
        ("data", 2),
        ("tensor_expert_data", 2),
        ("tensor_expert", 2),
    ]


def test_context_between_tensor_and_data():
    # 8 devices: attention 2 data x 2 context x 2 tensor; MoE 2 expert data x 4 experts. The
    # context pairs of tensor pairs, (0..3) and (4..7), are the expert groups.
    axes = [(axis.name, axis.size) for axis in mesh_axes(2, 2, 4, 1, context=2)]
    assert axes == [("expert", 1), ("data", 2), ("context", 2), ("tensor_expert", 2)]
    names = tuple(name for name, _ in axes)
    assert axes_for_role("context", names) == ("context",)
    assert axes_for_role("expert", names) == ("expert", "context", "tensor_expert")
    assert axes_for_role("data", names) == ("expert", "data")
    # Context parallelism wider than the expert group: its outer half replicates experts.
    axes = [(axis.name, axis.size) for axis in mesh_axes(2, 1, 4, 1, context=8)]
    assert axes == [("data", 1), ("expert", 1), ("context_expert_data", 2), ("context", 4)]


def test_layouts_that_do_not_nest_are_refused_with_the_fields_named():
    with pytest.raises(ConfigError, match=r"parallel.tensor=3 does not divide the 8 devices"):
        ParallelConfig(data=1, expert=8, tensor=3)
    # 12 devices; tensor groups of 4 straddle the expert groups of 2 x 3 = 6.
    with pytest.raises(
        ConfigError, match=r"parallel.tensor=4 does not fold .* 4 does not divide 6"
    ):
        ParallelConfig(data=2, expert=3, expert_tensor=2, tensor=4)


def test_split_widths_are_checked_up_front():
    folded = ParallelConfig(data=2, expert=4, tensor=2)
    with pytest.raises(ConfigError, match=r"model.num_heads=3 is not divisible by parallel.tensor"):
        Config(model=ModelConfig(num_heads=3, d_model=96), parallel=folded)
    with pytest.raises(ConfigError, match=r"moe.d_expert=6 is not divisible by"):
        Config(
            moe=MoEConfig(d_expert=6),
            parallel=ParallelConfig(data=1, expert=2, expert_tensor=4),
        )


def test_mesh_roles_and_token_spec_on_a_folded_mesh():
    parallel = ParallelConfig(data=2, expert=4, tensor=2)
    mesh = build_mesh(parallel)
    assert mesh.axis_names == ("data", "expert", "tensor_expert")
    assert list(mesh.devices.flat) == jax.devices()
    assert token_spec(mesh) == PartitionSpec(("data", "expert"))
    assert Config(parallel=parallel).tokens_per_device == 32 // 4 * 128 // 2

    every_axis = PartitionSpec(mesh.axis_names)

    def groups(role):
        def per_device(x):
            index = jax.lax.axis_index(role_axes(role)) if role_axes(role) else 0
            return x * 0 + index

        mapped = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=PartitionSpec(mesh.axis_names),
            out_specs=PartitionSpec(mesh.axis_names),
        )
        zeros = jax.device_put(np.zeros(8, np.int32), NamedSharding(mesh, every_axis))
        return np.asarray(jax.jit(mapped)(zeros))

    # Device i's index inside its tensor pair and inside its expert group of 4.
    np.testing.assert_array_equal(groups("tensor"), [0, 1] * 4)
    np.testing.assert_array_equal(groups("expert"), [0, 1, 2, 3] * 2)
    assert role_axes("tensor") == ()  # outside a shard_map: one device, no group
