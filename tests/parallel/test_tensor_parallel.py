"""The sequence-parallel collectives: slice, gather and scatter agree on who owns what."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.config.layout import TENSOR
from jaxmoe.parallel.mesh import build_mesh, role_axes
from jaxmoe.parallel.sequence_split import sequence_slice
from jaxmoe.parallel.tensor_parallel import gather_sequence, scatter_sequence

# Tensor groups of 4 devices that span two mesh axes (tensor_expert_data, tensor_expert).
FOLDED = ParallelConfig(data=4, expert=2, tensor=4)


def _on_every_device(fn, parallel: ParallelConfig, *args):
    """Run ``fn`` per device on ``args`` (replicated); results stacked over devices."""
    mesh = build_mesh(parallel)
    axes = tuple(mesh.axis_names)

    def per_device(*local):
        return jax.tree.map(lambda out: out[None], fn(*local))

    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(PartitionSpec() for _ in args),
        out_specs=PartitionSpec(axes),
        check_vma=False,
    )
    replicated = [jax.device_put(a, NamedSharding(mesh, PartitionSpec())) for a in args]
    return jax.tree.map(np.asarray, jax.jit(mapped)(*replicated))


def test_the_tensor_group_spans_the_inner_mesh_axes():
    mesh = build_mesh(FOLDED)
    assert mesh.axis_names == ("expert", "data", "tensor_expert_data", "tensor_expert")
    seen = []

    def per_device(x):
        seen.append(role_axes(TENSOR))
        return x

    mapped = jax.shard_map(
        per_device, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec()
    )
    jax.make_jaxpr(mapped)(jnp.zeros(()))
    assert seen == [("tensor_expert_data", "tensor_expert")]
    assert role_axes(TENSOR) == ()  # outside a shard_map: one device


def test_each_device_holds_its_slice_and_gather_restores_the_sequence():
    rows = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)

    def slice_then_gather(x):
        local = sequence_slice(x)
        return local, gather_sequence(local)

    local, gathered = _on_every_device(slice_then_gather, FOLDED, rows)
    # Device d of the (row-major) mesh is rank d % 4 of its tensor group.
    for device in range(8):
        rank = device % 4
        np.testing.assert_array_equal(local[device], rows[:, 2 * rank : 2 * rank + 2])
        np.testing.assert_array_equal(gathered[device], rows)


def test_scatter_sums_the_group_and_keeps_the_own_slice():
    rows = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)

    def scaled_then_scattered(x):
        # Each device contributes its own partial sum: (1 + rank) * x.
        rank = jax.lax.axis_index(role_axes(TENSOR))
        return scatter_sequence((1 + rank).astype(x.dtype) * x)

    scattered = _on_every_device(scaled_then_scattered, FOLDED, rows)
    for device in range(8):
        rank = device % 4
        np.testing.assert_array_equal(
            scattered[device], (1 + 2 + 3 + 4) * rows[:, 2 * rank : 2 * rank + 2]
        )


def test_one_device_groups_emit_no_collective():
    def program(x):
        return scatter_sequence(gather_sequence(sequence_slice(x)))

    mesh = build_mesh(ParallelConfig(data=2, expert=4))
    jaxpr = jax.make_jaxpr(
        jax.shard_map(program, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec())
    )(jnp.zeros((2, 8, 3)))
    body = jaxpr.jaxpr.eqns[0].params["jaxpr"]
    assert [eqn.primitive.name for eqn in body.eqns] == []
    # And outside any shard_map (one device) they are the identity.
    x = jnp.arange(6.0).reshape(1, 2, 3)
    np.testing.assert_array_equal(scatter_sequence(gather_sequence(sequence_slice(x))), x)
