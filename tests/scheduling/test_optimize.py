"""optimize end to end: bitwise equality, async StableHLO, report, sync fallback, policy checks."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import scheduling
import scheduling.names
import scheduling.runtime.pinning
from scheduling.policy import ExperimentalOptions, SchedulePolicy
from scheduling.profiles import PROFILE_FILES
from scheduling.program import jax_adapter
from scheduling.program.capture import capture
from scheduling.program.graph import Kind, Role
from tests.scheduling.toys import (
    in_specs,
    mesh_x,
    out_specs,
    put,
    reference,
    toy_args,
    toy_step_reg,
)

STEP = toy_step_reg  # three parameters, two layers, a regulariser
IN_SPECS, OUT_SPECS = in_specs(reg=True), out_specs(reg=True)
POLICY_NAMES = ["none", "async", "dw"]


def _args():
    return toy_args(reg=True)


@functools.cache
def _reference():
    return reference(STEP, mesh_x(), IN_SPECS, OUT_SPECS)


@functools.cache
def _optimized(policy):
    return scheduling.optimize(
        STEP, *_args(), mesh=mesh_x(), in_specs=IN_SPECS, out_specs=OUT_SPECS, policy=policy
    )


@functools.cache
def _program():
    return capture(STEP, *_args(), mesh=mesh_x(), in_specs=IN_SPECS, out_specs=OUT_SPECS)


def _iterate(step, params, x, steps=3):
    losses = []
    for _ in range(steps):
        params, loss = step(params, x)
        losses.append(loss)
    return params, losses


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_scheduled_step_is_bitwise_equal_to_shard_map(policy):
    step, _ = _optimized(policy)
    params, x = _args()
    got = _iterate(step, params, x)
    expected = _iterate(_reference(), params, x)
    chex.assert_trees_all_equal(got, expected)
    # The losses change from step to step: the parameters really were updated.
    assert len({float(loss) for loss in got[1]}) == 3


def test_donate_argnums_donates_the_parameters():
    mesh = mesh_x()
    params, x = _args()
    step, _ = scheduling.optimize(
        STEP,
        params,
        x,
        mesh=mesh,
        in_specs=IN_SPECS,
        out_specs=OUT_SPECS,
        policy="dw",
        donate_argnums=(0,),
    )
    expected = _reference()(params, x)
    donated = jax.tree.map(jnp.copy, params)
    got = step(donated, x)
    chex.assert_trees_all_equal(got, expected)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
    assert not x.is_deleted()


def test_scheduled_step_checks_argument_structure():
    step, _ = _optimized("none")
    params, x = _args()
    with pytest.raises(TypeError, match="structure"):
        step(params[:2], x)


def test_compile_ahead_of_time_matches():
    step, _ = _optimized("async")
    params, x = _args()
    compiled = step.compile(params, x)
    chex.assert_trees_all_equal(compiled(params, x), _reference()(params, x))


def _for_gpu(monkeypatch, policy="dw"):
    """The step as emitted for a GPU mesh (barriers and marks), on this CPU mesh."""
    monkeypatch.setattr(scheduling.runtime.pinning, "target_platform", lambda mesh: "gpu")
    step, _ = scheduling.optimize(
        STEP, *_args(), mesh=mesh_x(), in_specs=IN_SPECS, out_specs=OUT_SPECS, policy=policy
    )
    return step


def test_a_compiled_step_says_what_the_compiler_kept_of_its_windows(monkeypatch):
    step = _for_gpu(monkeypatch)
    windows = step.compile(*_args()).windows()
    text = step.lower(*_args()).as_text()
    pinned = {int(g) for g in re.findall(r'_scheduled_window = "(\d+)"', text)}
    assert windows.emitted == len(pinned) > 0
    # XLA:CPU runs every async pair synchronously: no window and no pair is left.
    assert (windows.kept, windows.collectives) == (0, 0)


def test_groups_are_withheld_where_the_compiler_mishandles_them(monkeypatch):
    platforms = []

    def withheld(platform):
        platforms.append(platform)
        return "this compiler crashes on them"

    monkeypatch.setattr(jax_adapter, "xla_groups_withheld", withheld)
    step, _ = scheduling.optimize(
        STEP, *_args(), mesh=mesh_x(), in_specs=IN_SPECS, out_specs=OUT_SPECS, policy="dw",
        experimental=ExperimentalOptions(xla_groups=True),
    )  # fmt: skip
    assert platforms == ["cpu"]  # asked for the mesh's own platform
    assert (step.pinned.windows, step.pinned.withheld) == (0, "this compiler crashes on them")
    assert "_scheduling_group_id" not in step.lower(*_args()).as_text()
    line = step.compile(*_args()).windows().line()
    assert line.startswith("scheduled windows not emitted as scheduling groups (this compiler")


def test_no_supported_xla_is_known_to_mishandle_groups():
    # jax 0.10.2's XLA:GPU crashed on them; it is below the supported range.
    assert jax_adapter.jax_supported()
    assert not jax_adapter.jax_supported("0.10.2")
    assert jax_adapter.xla_groups_withheld("cpu") is None
    assert jax_adapter.xla_groups_withheld("gpu") is None


@functools.cache
def _stablehlo(policy):
    step, _ = _optimized(policy)
    return step.lower(*_args()).as_text()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_stablehlo_has_one_async_pair_per_collective(policy):
    text = _stablehlo(policy)
    expected = 0 if policy == "none" else len(_program().collectives())
    # 4 all_to_alls, 3 gradient psums and the loss psum.
    assert expected in (0, 8)
    assert jax_adapter.stablehlo_async_pairs(text) == (expected, expected)


def test_stablehlo_of_dw_for_gpu_pins_its_windows_between_barriers(monkeypatch):
    # For these CPUs, nothing: XLA:CPU runs the collectives synchronously. (Lowered
    # before the platform is patched: ``_optimized`` keeps its step.)
    assert not any(word in _stablehlo("dw") for word in ("_scheduled_window", "barrier"))
    text = _for_gpu(monkeypatch).lower(*_args()).as_text()
    windows = {int(g) for g in re.findall(r'_scheduled_window = "(\d+)"', text)}
    assert windows and text.count("stablehlo.optimization_barrier") == 2 * len(windows)
    assert "_scheduling_group_id" not in text


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_report_lists_every_collective_by_kind(policy):
    _, report = _optimized(policy)
    captured = Counter(op.primitive for op in _program().collectives())
    assert Counter(c.kind for c in report.collectives) == captured
    assert len(report.collectives) == sum(captured.values())
    assert report.totals()["by_kind"] == dict(sorted(captured.items()))
    assert report.policy == policy
    assert report.ops == len(_program().ops)
    assert all(c.is_async == (policy != "none") for c in report.collectives)
    assert [c.index for c in report.collectives] == list(range(len(report.collectives)))
    data = report.to_json()
    assert json.loads(json.dumps(data)) == data
    assert data["totals"]["collectives"] == len(report.collectives)
    table = report.table()
    for kind in captured:
        assert kind in table
    assert f"schedule '{policy}'" in table


def test_report_of_dw_places_work_and_saves(tmp_path):
    _, report = _optimized("dw")
    graph, order, *_ = scheduling.schedule(_program(), SchedulePolicy(name="dw"))
    assert report.dw_ops == sum(kind is Kind.BACKWARD_DW for kind in graph.kinds) > 0
    assert report.forced_placements == len(order.placement.forced)
    assert report.withdrawn_placements == len(order.withdrawn)
    assert report.dw_ops_placed == sum(len(c.placed_ops) for c in report.collectives)
    assert report.dw_ops_placed > 0
    placed_in = {c.kind for c in report.collectives if c.placed_ops}
    assert placed_in == {"all_to_all"}
    assert report.step_seconds <= report.baseline_step_seconds
    path = tmp_path / "report.json"
    report.save(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(report.to_json()))


def test_report_of_none_is_the_baseline():
    _, report = _optimized("none")
    assert report.step_seconds == pytest.approx(report.baseline_step_seconds)
    assert report.overlap_seconds == pytest.approx(0.0, abs=1e-12)
    assert report.dw_ops_placed == 0


def test_the_schedule_of_none_splits_nothing():
    graph, order, *_ = scheduling.schedule(_program(), SchedulePolicy(name="none"))
    assert not [n for n in graph.nodes if n.role is not Role.COMPUTE]
    assert order.nodes == list(range(len(graph.nodes)))


@pytest.fixture
def no_async(monkeypatch):
    monkeypatch.setattr(jax_adapter, "async_collectives_available", lambda: False)
    monkeypatch.setattr(jax_adapter, "_ASYNC_PRIMITIVES", {})


def test_without_async_primitives_optimize_refuses_with_a_clear_message(no_async):
    with pytest.raises(jax_adapter.AsyncCollectivesUnavailable) as error:
        scheduling.optimize(STEP, *_args(), mesh=mesh_x(), in_specs=IN_SPECS, out_specs=OUT_SPECS)
    message = str(error.value)
    assert jax.__version__ in message
    assert 'transport="sync"' in message


def test_without_async_primitives_the_sync_transport_is_exact(no_async):
    params, x = _args()
    policy = SchedulePolicy(name="dw", transport="sync")
    step, report = scheduling.optimize(
        STEP, params, x, mesh=mesh_x(), in_specs=IN_SPECS, out_specs=OUT_SPECS, policy=policy
    )
    chex.assert_trees_all_equal(_iterate(step, params, x), _iterate(_reference(), params, x))
    text = step.lower(params, x).as_text()
    assert jax_adapter.stablehlo_async_pairs(text) == (0, 0)
    assert len(report.collectives) == len(_program().collectives())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "fast"}, "name"),
        ({"profile": "tpu-v9"}, "profile"),
        ({"max_live_bytes_growth": -0.5}, "max_live_bytes_growth"),
        ({"partition_chunks": 1}, "partition_chunks"),
        ({"name": "expert_pipeline"}, "partition_chunks"),
        ({"transport": "socket"}, "ExperimentalOptions.transport"),
        ({"xla_pin": "groups"}, "ExperimentalOptions.xla_groups"),
    ],
)
def test_schedule_policy_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulePolicy(**kwargs)


def test_optimize_rejects_an_unknown_policy_name():
    with pytest.raises(ValueError, match="name"):
        scheduling.optimize(
            STEP, *_args(), mesh=mesh_x(), in_specs=IN_SPECS, out_specs=OUT_SPECS, policy="fast"
        )


def test_schedule_policy_profiles():
    assert SchedulePolicy().device_profile is scheduling.PROFILES["a100"]
    custom = scheduling.PROFILES["cpu"].with_link(1e9)
    assert SchedulePolicy(profile=custom).device_profile is custom
    assert (
        SchedulePolicy(profile=str(PROFILE_FILES / "a100-8x-nvlink-400g.json")).device_profile
        == (scheduling.PROFILES["a100-8x-nvlink-400g"])
    )
    # The partitioning policies need batch arguments: they are tested in test_partition;
    # the exchange decompositions in test_exchange.
    partitioning = {"partition", "lancet", "expert_pipeline", "lancet+comet"}
    # The pair policy needs microbatches: tested in tests/train/test_pair_schedule.py.
    assert set(scheduling.names.POLICIES) == {*POLICY_NAMES, *partitioning, "comet", "pair"}


def test_xla_gpu_flags():
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in scheduling.xla_gpu_flags()


def _control_flow_step(w, x):
    def body(carry, row):
        return carry + jax.lax.psum(row, "x"), None

    total, _ = jax.lax.scan(body, jnp.zeros(x.shape[1]), x)
    y = jax.lax.cond(total[0] > 0, lambda v: v * 2.0, lambda v: v - 1.0, x @ w.T)
    return jax.lax.all_to_all(y, "x", 0, 0, tiled=True)


def _collective_kinds_step(w, x):
    return (
        jax.lax.ppermute(x, "x", [(i, (i + 1) % 8) for i in range(8)]),
        jax.lax.all_gather(x, "x", tiled=True),
        jax.lax.psum_scatter(x, "x", scatter_dimension=0, tiled=True),
        jax.lax.psum_scatter(w, "x", scatter_dimension=0, tiled=False),  # no async form
        jax.lax.psum((w, 2.0 * w), "x"),
    )


@pytest.mark.parametrize(
    ("step", "out_specs", "n_async", "not_understood"),
    [
        (_control_flow_step, P("x"), 1, ["cond@<top>", "scan@<top>"]),
        (
            _collective_kinds_step,
            (P("x"), P(), P("x"), P("x"), (P(), P())),
            5,
            ["reduce_scatter@<top>"],
        ),
    ],
    ids=["control_flow", "collective_kinds"],
)
def test_other_steps_are_exact_and_report_what_stays_in_place(
    step, out_specs, n_async, not_understood
):
    mesh = mesh_x()
    w = jax.device_put(jnp.eye(8, 4, dtype=jnp.float32), NamedSharding(mesh, P()))
    x = jax.device_put(
        jnp.linspace(-1.0, 1.0, 64 * 4, dtype=jnp.float32).reshape(64, 4),
        NamedSharding(mesh, P("x")),
    )
    specs = (P(), P("x"))
    scheduled, report = scheduling.optimize(
        step, w, x, mesh=mesh, in_specs=specs, out_specs=out_specs, policy="dw"
    )
    chex.assert_trees_all_equal(scheduled(w, x), reference(step, mesh, specs, out_specs)(w, x))
    starts, _ = jax_adapter.stablehlo_async_pairs(scheduled.lower(w, x).as_text())
    assert starts == n_async
    assert sum(c.is_async for c in report.collectives) == n_async
    assert report.not_understood == not_understood


def _two_branch_step(params, x, y):
    """Two independent all-to-all branches: each backward window could take work that the
    other window's all-to-all needs, which would close a cycle."""

    def exchange(v):
        return jax.lax.all_to_all(v, "x", 0, 0, tiled=True)

    def loss(params):
        w1, w2 = params
        e1, e2 = exchange(x @ w1), exchange(y @ w2)
        # Read by both branches' gradients, so each window can run the other's work.
        scale = jax.lax.stop_gradient(jnp.mean(e1) + jnp.mean(e2))
        return jnp.sum(e1**2 * scale) + jnp.sum(e2**2 * scale)

    value, grads = jax.value_and_grad(loss)(params)
    grads = jax.tree.map(lambda g: jax.lax.psum(g, "x"), grads)
    return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), jax.lax.psum(value, "x")


def test_placements_that_would_close_a_cycle_are_withdrawn():
    mesh = mesh_x()
    rng = np.random.default_rng(0)
    specs = ((P(), P()), P("x"), P("x"))
    params = tuple(put(mesh, rng.normal(size=(16, 16)).astype(np.float32), P()) for _ in "ab")
    x, y = (put(mesh, rng.normal(size=(64, 16)).astype(np.float32), P("x")) for _ in "xy")
    policy = SchedulePolicy(name="dw", max_live_bytes_growth=10.0)
    step, report = scheduling.optimize(
        _two_branch_step,
        params,
        x,
        y,
        mesh=mesh,
        in_specs=specs,
        out_specs=((P(), P()), P()),
        policy=policy,
    )
    assert report.withdrawn_placements >= 1
    reference = jax.jit(
        jax.shard_map(
            _two_branch_step,
            mesh=mesh,
            in_specs=specs,
            out_specs=((P(), P()), P()),
            check_vma=False,
        )
    )
    chex.assert_trees_all_equal(step(params, x, y), reference(params, x, y))
