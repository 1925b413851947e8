"""A measurement of schedules on the emulated cluster: its request, its per-round figures and
its table (the runs themselves are measurements, in experiments/results/)."""

import dataclasses
import math
from pathlib import Path

import pytest

from experiments.emulation.link_curves import config_flags
from experiments.emulation.schedule_runs import (
    ScheduleRequest,
    format_table,
    schedule_results,
)
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import ConfigError


def test_results_pair_each_round_with_the_baseline_of_the_same_round():
    # A drift that slows round 1 for both schedules must not show as a speedup range.
    shaped = {"none": [1.0, 2.0, 1.1], "dw": [0.5, 1.0, 0.55]}
    free = {"none": [0.4, 0.5, 0.6], "dw": [0.3, 0.3, 0.3]}
    none, dw = schedule_results(shaped, free, tokens_per_step=1000)
    assert (none.speedup, none.speedup_min, none.speedup_max) == (1.0, 1.0, 1.0)
    assert dw.speedup == dw.speedup_min == dw.speedup_max == 2.0
    assert (dw.step_s, dw.step_min_s, dw.step_max_s) == (0.55, 0.5, 1.0)
    assert dw.compute_only_s == 0.3 and dw.exposed_communication_s == 0.55 - 0.3
    assert dw.tokens_per_s == 1000 / 0.55 and dw.step_rounds_s == tuple(shaped["dw"])
    (unmeasured,) = schedule_results({"none": [1.0]}, None, tokens_per_step=1)
    assert math.isnan(unmeasured.compute_only_s) and unmeasured.compute_only_rounds_s == ()


def test_table_reports_spread_and_exposed_communication():
    (row,) = schedule_results({"none": [0.5, 0.4, 0.6]}, {"none": [0.4]}, 500)
    report = {
        "hosts": 2,
        "devices_per_host": 4,
        "link_mbit": 300.0,
        "delay_ms": 0.0,
        "preset": "tiny",
        "repeats": 3,
        "warmup": 1,
        "machine": "x86_64, 2 CPU cores",
        "communication_only_s": 0.2,
        "communication_only_free_link_s": 0.05,
        "schedules": [dataclasses.asdict(row)],
    }
    table = format_table(report)
    assert (
        "| none | 500.0 [400.0-600.0] | 1.000 [1.000-1.000] | 400.0 | 200.0 | 100.0 | 0.50 |"
        in (table)
    )
    assert "3 interleaved rounds after 1 untimed" in table and "2 CPU cores" in table
    assert "free link: 50.0 ms" in table


def test_a_request_is_checked_before_anything_starts():
    with pytest.raises(ConfigError, match=r"\['fast'\] not among"):
        ScheduleRequest(schedules=("none", "fast")).check()
    with pytest.raises(ConfigError, match="2 hosts x 1 devices = 2"):
        ScheduleRequest(devices_per_host=1).check()
    with pytest.raises(ConfigError, match="--repeats"):
        ScheduleRequest(repeats=0).check()
    with pytest.raises(ConfigError, match="delay_ms"):
        ScheduleRequest(delay_ms=-1.0).check()
    with pytest.raises(ConfigError, match=r"--schedules expert_pipeline: .*pipelining degree"):
        ScheduleRequest(schedules=("none", "expert_pipeline")).check()
    config = ScheduleRequest(overrides=("--moe.top_k", "2")).check()
    assert config.moe.top_k == 2


def test_a_request_names_the_command_that_makes_it():
    request = ScheduleRequest(
        schedules=("none", "expert_pipeline:2"),
        overrides=("--moe.top_k", "2"),
        shaped_only=True,
        sweep=Path("curves.json"),
    )
    command = request.command("out.json")
    assert command.startswith("python -m experiments.cluster --hosts 2 --devices-per-host 4 ")
    assert "--schedules none,expert_pipeline:2 --json out.json --sweep curves.json" in command
    assert command.endswith("--shaped-only --moe.top_k 2")


def test_link_curves_run_on_the_configuration_given_as_flags():
    for argv in (
        [],
        ["--preset", "small"],
        ["--moe.capacity_factor", "none", "--train.learning_rate", "1e-4"],
        ["--schedule.transport", "sync", "--schedule.profile", "cpu"],
    ):
        config = config_from_train_args(argv)
        assert config_from_train_args(config_flags(config)) == config, argv
