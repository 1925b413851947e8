"""Measured op costs: timed once per distinct op, cached per backend, used by the policy."""

import jax
import numpy as np

import scheduling
from scheduling.cost import PROFILES, CostModel
from scheduling.policy import SchedulePolicy
from scheduling.profiling import OpProfiler, ProfiledCostModel, op_key
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
        if op.is_collective:
            assert profiled.seconds(op) == analytic.seconds(op)
        elif op_key(op) is not None:
            assert profiled.seconds(op) == profiled.profiler.seconds(op)


def test_measured_policy_schedules_exactly(tmp_path):
    mesh, args = mesh_x(), toy_args()
    policy = SchedulePolicy(name="dw", op_costs="measured", op_cost_cache=str(tmp_path))
    step, report = scheduling.optimize(
        toy_step, *args, mesh=mesh, in_specs=in_specs(), out_specs=out_specs(), policy=policy
    )
    assert report.profile.endswith("measured ops")
    assert (tmp_path / f"ops-{jax.default_backend()}.json").exists()
    reference = jax.jit(
        jax.shard_map(
            toy_step, mesh=mesh, in_specs=in_specs(), out_specs=out_specs(), check_vma=False
        )
    )
    jax.tree.map(np.testing.assert_array_equal, step(*args), reference(*args))
