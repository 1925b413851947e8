"""Measured op costs: timed once per distinct op, cached per backend, used by the policy."""

from dataclasses import replace

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import scheduling
from scheduling.costs.cost_model import FREE_PRIMITIVES, FUSIBLE, CostModel
from scheduling.costs.profiling import OpProfiler, ProfiledCostModel, op_key
from scheduling.policy import SchedulePolicy
from scheduling.profiles import PROFILES
from tests.scheduling.toys import in_specs, mesh_x, out_specs, toy_args, toy_program, toy_step


def test_keys_identify_ops_by_primitive_parameters_and_shapes():
    program, again = toy_program(), toy_program()
    keys = [op_key(op) for op in program.ops]
    assert keys == [op_key(op) for op in again.ops]  # stable across captures
    for op, key in zip(program.ops, keys, strict=True):
        if op.is_collective:
            assert key is None  # needs the whole mesh
        elif key is not None:
            assert key.startswith(op.primitive + "|")
    dots = [k for op, k in zip(program.ops, keys, strict=True) if op.primitive == "dot_general"]
    assert dots and all(k is not None and "dimension_numbers" in k for k in dots)


def test_each_distinct_op_is_timed_once_and_cached_on_disk(tmp_path):
    program = toy_program()
    profiler = OpProfiler(tmp_path, warmup=1, repeats=2)
    measured = [profiler.seconds(op) for op in program.ops]
    distinct = {op_key(op) for op in program.ops} - {None}
    assert profiler.measured == len(distinct)
    assert all(s is None or s > 0 for s in measured)
    profiler.save()
    assert (tmp_path / f"ops-{jax.default_backend()}.json").exists()

    reloaded = OpProfiler(tmp_path)
    assert [reloaded.seconds(op) for op in program.ops] == measured
    assert reloaded.measured == 0


def test_profiled_model_measures_compute_and_keeps_the_link_model(tmp_path):
    program = toy_program()
    analytic = CostModel(PROFILES["cpu"], dict(program.mesh.shape))
    profiled = ProfiledCostModel(
        PROFILES["cpu"], dict(program.mesh.shape), OpProfiler(tmp_path, warmup=1, repeats=2)
    )
    for op in program.ops:
        if op.is_collective or op.primitive in FREE_PRIMITIVES:
            assert profiled.seconds(op) == analytic.seconds(op)
        elif op_key(op) is not None:
            assert profiled.seconds(op) == profiled.profiler.seconds(op)


def test_fusing_profile_keeps_the_roofline_for_fusible_ops(tmp_path):
    program = toy_program()
    profile = replace(PROFILES["cpu"], fused_elementwise=True)
    analytic = CostModel(profile, dict(program.mesh.shape))
    profiled = ProfiledCostModel(
        profile, dict(program.mesh.shape), OpProfiler(tmp_path, warmup=1, repeats=2)
    )
    for op in program.ops:
        profiled.seconds(op)
    fusible = [op for op in program.ops if op.primitive in FUSIBLE]
    assert fusible
    assert [profiled.seconds(op) for op in fusible] == [analytic.seconds(op) for op in fusible]
    assert profiled.profiler.measured == len(
        {op_key(op) for op in program.ops if op.primitive not in FUSIBLE | FREE_PRIMITIVES} - {None}
    )


def test_reductions_over_array_axes_are_profiled_and_mesh_reductions_are_not():
    def step(x):
        return jax.lax.psum(jnp.sum(x, axis=1), "x")

    mesh = mesh_x()
    program = scheduling.capture(
        step,
        jax.ShapeDtypeStruct((64, 4), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P(),
    )
    keys = {op.primitive: op_key(op) for op in program.ops}
    assert keys["reduce_sum"] is not None
    assert keys["psum"] is None


def test_a_copy_costs_what_it_adds_not_the_dispatch(tmp_path, monkeypatch):
    # A run of n copies takes the dispatch plus n times the op: the cost is the op alone.
    dispatch, per_copy = 40e-6, 3e-6
    runs = []

    def median(self, executable, operand_sets):
        runs.append(len(operand_sets))
        return dispatch + per_copy * len(operand_sets)

    monkeypatch.setattr(OpProfiler, "_median", median)
    program = toy_program()
    mul = next(op for op in program.ops if op.primitive == "mul")
    profiler = OpProfiler(tmp_path, chain=8)
    assert profiler.seconds(mul) == pytest.approx(per_copy)
    assert runs == [1, 8]


def test_an_op_lost_in_the_noise_is_never_free(tmp_path, monkeypatch):
    # Noise can make eight copies time as one (or faster): a floor keeps the op's cost positive.
    monkeypatch.setattr(OpProfiler, "_median", lambda self, executable, sets: 40e-6)
    program = toy_program()
    mul = next(op for op in program.ops if op.primitive == "mul")
    assert OpProfiler(tmp_path, chain=8).seconds(mul) == pytest.approx(0.05 * 40e-6 / 7)


def test_ops_run_on_every_device_of_the_mesh_at_once(tmp_path):
    program = toy_program()
    profiler = OpProfiler(tmp_path, warmup=1, repeats=2, mesh=program.mesh)
    dot = next(op for op in program.ops if op.primitive == "dot_general")
    assert profiler.seconds(dot) > 0
    profiler.save()
    assert (tmp_path / f"ops-{jax.default_backend()}-x{program.mesh.devices.size}.json").exists()


def test_measured_policy_schedules_exactly(tmp_path):
    mesh, args = mesh_x(), toy_args()
    policy = SchedulePolicy(name="dw", op_costs="measured", op_cost_cache=str(tmp_path))
    step, report = scheduling.optimize(
        toy_step, *args, mesh=mesh, in_specs=in_specs(), out_specs=out_specs(), policy=policy
    )
    assert report.profile.endswith("measured ops")
    # Fake CPU devices share the cores: ops are timed on all devices of the mesh at once.
    assert (tmp_path / f"ops-{jax.default_backend()}-x{mesh.devices.size}.json").exists()
    reference = jax.jit(
        jax.shard_map(
            toy_step, mesh=mesh, in_specs=in_specs(), out_specs=out_specs(), check_vma=False
        )
    )
    chex.assert_trees_all_equal(step(*args), reference(*args))


def test_a_prng_key_operand_is_costed_at_the_full_width_peak():
    """Router noise puts PRNG keys (an extended dtype, not a NumPy one) into the step."""
    profile = PROFILES["a100-8x-nvlink-400g"]
    key_dtype = jax.random.key(0).dtype
    assert profile.peak_flops_per_s(key_dtype) == profile.peak_flops_per_s(jnp.float32)
    assert profile.peak_flops_per_s(jnp.bfloat16) == profile.half_precision_flops_per_s
