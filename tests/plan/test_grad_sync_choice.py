"""``train.grad_sync auto``: estimates from the cost model times measured convergence costs,
a choice that follows the link and the costs."""

import dataclasses
import json

import pytest
from jax.sharding import Mesh

import scheduling
from jaxmoe.cli.main import main
from jaxmoe.config import ParallelConfig, ScheduleConfig
from jaxmoe.parallel import mesh as mesh_module
from jaxmoe.parallel.grad_sync import ALGORITHMS, EXACT
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.plan import grad_sync_choice
from jaxmoe.plan.grad_sync_choice import (
    CONVERGENCE_FILE,
    TARGET_FRACTION,
    ConvergenceCosts,
    choice_cost_model,
    choose_grad_sync,
    fixed_cost,
    resolve_grad_sync,
)
from jaxmoe.plan.grad_sync_trial import measured_step_seconds, trial_batches
from jaxmoe.train.scheduled import capture_train_step
from tests.train.runs import ONE_LAYER, one_layer_config, small_config, with_schedule

RELAXED = [name for name in ALGORITHMS if name not in EXACT]
# Every relaxed algorithm as good as an exact one: the choice is the estimated step's.
FREE = ConvergenceCosts("test: no convergence cost", TARGET_FRACTION, dict.fromkeys(RELAXED, 1.0))


def linked(link_mbit: float) -> scheduling.DeviceProfile:
    """The cpu profile with a link of ``link_mbit`` Mbit/s per device."""
    return scheduling.PROFILES["cpu"].with_link(link_mbit * 1e6 / 8)


def config_told(link_mbit: float, base=small_config, **schedule_fields):
    config = base(grad_sync="auto", grad_sync_devices_per_host=4)
    config = with_schedule(config, profile=linked(link_mbit), **schedule_fields)
    return dataclasses.replace(config, parallel=ParallelConfig(data=2, expert=4))


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(ParallelConfig(data=2, expert=4))


@pytest.fixture(scope="module", autouse=True)
def _one_capture_per_algorithm():
    """The choices below differ in the link, the trial and the convergence costs, none of
    which changes the captured step: each algorithm's step is captured once per module."""
    captured = {}

    def capture_once(run):
        key = dataclasses.replace(
            run.config,
            schedule=ScheduleConfig(),
            train=dataclasses.replace(
                run.config.train, grad_sync_trial_steps=0, grad_sync_trial_margin=0.0
            ),
        )
        if key not in captured:
            captured[key] = capture_train_step(run)
        return captured[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grad_sync_choice, "capture_train_step", capture_once)
        yield


@pytest.fixture(scope="module")
def choices(mesh):
    return {link: choose_grad_sync(config_told(link), mesh, FREE) for link in (1.0, 1e6)}


def test_every_algorithm_is_estimated_and_the_slower_link_costs_more(choices):
    slow, fast = choices[1.0], choices[1e6]
    assert [e.name for e in slow.estimates] == list(ALGORITHMS)
    for slow_estimate, fast_estimate in zip(slow.estimates, fast.estimates, strict=True):
        assert slow_estimate.sync_seconds > fast_estimate.sync_seconds
    by_name = {e.name: e for e in slow.estimates}
    # 8-bit codes across the hosts: fewer bytes than floats.
    assert by_name["int8"].sync_seconds < by_name["hierarchical"].sync_seconds
    assert by_name["decentralized-int8"].sync_seconds < by_name["decentralized"].sync_seconds


def test_a_slow_link_picks_a_relaxed_algorithm_and_a_fast_one_an_exact_one(choices):
    slow, fast = choices[1.0], choices[1e6]
    assert slow.chosen not in EXACT
    assert fast.chosen in EXACT
    for choice in (slow, fast):
        chosen = next(e for e in choice.estimates if e.name == choice.chosen)
        assert chosen.time_to_loss == min(e.time_to_loss for e in choice.estimates)
    assert f"grad_sync auto -> {fast.chosen}" in fast.table()
    assert "1 Mbit/s between hosts" in slow.table()


def test_the_convergence_cost_weighs_on_the_step(choices, mesh):
    """A relaxed algorithm that needs more steps loses the choice it wins per step; one
    without a measurement (or that never reached the loss) is never chosen."""
    slow = choices[1.0]
    by_step = sorted(slow.estimates, key=lambda e: e.step_seconds)
    fastest, runner_up = by_step[0], by_step[1]
    assert fastest.name == slow.chosen
    slower = runner_up.step_seconds / fastest.step_seconds * 1.01
    steps = {**FREE.steps_per_allreduce_step, fastest.name: slower}
    costly = ConvergenceCosts("test", TARGET_FRACTION, steps)
    assert choose_grad_sync(config_told(1.0), mesh, costly).chosen == runner_up.name
    unmeasured = ConvergenceCosts("test", TARGET_FRACTION, {})
    chosen = choose_grad_sync(config_told(1.0), mesh, unmeasured)
    assert chosen.chosen in EXACT
    assert all(e.convergence is None for e in chosen.estimates if not e.exact)


def with_trial(config, margin: float):
    train = dataclasses.replace(
        config.train, grad_sync_trial_steps=3, grad_sync_trial_margin=margin
    )
    return dataclasses.replace(config, train=train)


def test_a_trial_decides_among_the_closest_estimates(choices, mesh):
    """The algorithms estimated within the margin of the best are measured, and the least
    measured time to a loss wins, whatever the estimates said; the others are not run."""
    estimated = sorted(choices[1.0].estimates, key=lambda e: e.time_to_loss)
    best, runner_up = estimated[0], estimated[1]
    margin = runner_up.time_to_loss / best.time_to_loss - 1 + 1e-9
    close = {e.name for e in estimated if e.time_to_loss <= best.time_to_loss * (1 + margin)}
    assert len(close) < len(estimated)  # precondition: some are left out
    # Measured, the estimates' order is reversed among the close ones.
    measured_steps = {e.name: 1.0 + rank for rank, e in enumerate(reversed(estimated))}
    asked = []
    measure = lambda name: asked.append(name) or measured_steps[name]
    choice = choose_grad_sync(with_trial(config_told(1.0), margin), mesh, FREE, measure)
    assert set(asked) == close
    assert choice.chosen == max(close, key=lambda name: [e.name for e in estimated].index(name))
    tried = {e.name: e.measured_step_seconds for e in choice.estimates}
    assert {name for name, seconds in tried.items() if seconds is not None} == close
    assert "tried" in choice.reason and "tried (ms)" in choice.table()


def test_no_trial_when_one_estimate_stands_alone(choices, mesh):
    asked = []
    choice = choose_grad_sync(
        with_trial(config_told(1.0), 0.0), mesh, FREE, lambda name: asked.append(name) or 1.0
    )
    assert asked == [] and choice.chosen == choices[1.0].chosen


def test_a_trial_times_the_run_own_steps(mesh):
    # The one-layer model: a trial times whatever step the run has.
    config = with_trial(config_told(1.0, one_layer_config), 0.15)
    seconds = measured_step_seconds(config, mesh, "allreduce", trial_batches(config))
    assert 0.0 < seconds < 60.0


def test_curves_set_the_cost_of_collectives_they_do_not_cover(mesh, tmp_path):
    """A curve file's fixed cost (its curves' median time at their smallest size) replaces
    the profile's latencies."""
    curves = {
        "source": "test",
        "curves": [{"kind": "psum", "group_size": 2, "bytes": [4096.0], "seconds": [0.004]}],
    }
    path = tmp_path / "curves.json"
    path.write_text(json.dumps(curves))
    cost, words = choice_cost_model(config_told(300.0, link_curves=str(path)), mesh)
    assert cost.profile.link_latency_s == 0.004 and cost.profile.node_link_latency_s == 0.0
    assert "fixed cost 4.0 ms" in words


def test_one_curve_timed_at_nothing_does_not_make_collectives_free(mesh, tmp_path):
    """A curve's smallest point is a difference of two noisy timings and can come out near
    zero (the all-gather's at 4 KiB on the 300 Mbit/s link did): the fixed cost is the
    median of the curves' smallest points, not the least."""
    smallest = {("psum", 2): 0.004, ("ppermute", 2): 0.003, ("all_gather", 2): 3e-7}
    curves = {
        "source": "test",
        "curves": [
            {"kind": kind, "group_size": group, "bytes": [4096.0, 4e6], "seconds": [t, 1.0]}
            for (kind, group), t in smallest.items()
        ],
    }
    path = tmp_path / "curves.json"
    path.write_text(json.dumps(curves))
    assert fixed_cost(scheduling.CollectiveCurves.load(path)) == 0.003
    cost, words = choice_cost_model(config_told(300.0, link_curves=str(path)), mesh)
    assert cost.profile.link_latency_s == 0.003 and "fixed cost 3.0 ms" in words


def test_the_shipped_costs_cover_every_relaxed_algorithm():
    costs = ConvergenceCosts.load(CONVERGENCE_FILE)
    assert costs.target_fraction == TARGET_FRACTION
    assert set(costs.steps_per_allreduce_step) == set(RELAXED)
    assert "experiments.grad_sync_convergence" in costs.source
    assert all(costs.of(name) == 1.0 for name in EXACT)


def test_resolve_leaves_a_named_algorithm_alone():
    config = small_config(grad_sync="int8")
    assert resolve_grad_sync(config, build_mesh(config.parallel)) == (config, None)


def test_train_says_what_auto_chose_and_runs_it(tmp_path, capsys, monkeypatch):
    built = []
    counted = lambda *args, **kwargs: built.append(Mesh(*args, **kwargs)) or built[-1]
    monkeypatch.setattr(mesh_module, "Mesh", counted)
    out = tmp_path / "run"
    argv = ["train", "--steps", "2", "--no-progress", "--out", str(out)]
    argv += ["--parallel.data", "2", "--parallel.expert", "4", "--train.grad_sync", "auto"]
    # The link told as a profile file of its own: the cpu profile at 1 Mbit/s.
    profile = tmp_path / "cpu-1mbit.json"
    profile.write_text(json.dumps(dataclasses.asdict(linked(1.0))))
    argv += ["--train.grad_sync_devices_per_host", "4", "--schedule.profile", str(profile)]
    argv += [*ONE_LAYER]
    assert main(argv) == 0
    # One preparation: the mesh is built once, the choice made once, for the whole run.
    assert len(built) == 1
    chosen = json.loads((out / "grad_sync_choice.json").read_text())
    assert chosen["chosen"] in ALGORITHMS
    assert {e["name"] for e in chosen["estimates"]} == set(ALGORITHMS)
    assert chosen["convergence_source"] == ConvergenceCosts.load().source
    # The run records the algorithm it ran, so that --resume finds its state.
    assert json.loads((out / "config.json").read_text())["train"]["grad_sync"] == chosen["chosen"]
    assert f"grad_sync auto -> {chosen['chosen']}" in capsys.readouterr().out
