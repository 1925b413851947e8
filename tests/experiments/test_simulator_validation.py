"""The validation's tables, and the regime it runs."""

import json
from pathlib import Path

import pytest

from experiments import simulator_validation
from experiments.emulation import instrument_model, overlap_regime


def _readings(*steps):
    return {
        name: {"step_s": step, "compute_s": 0.5, "communication_s": 1.0, "exposed_s": 0.25}
        for name, step in zip(instrument_model.READINGS, steps, strict=True)
    }


def test_control_table_sets_measured_per_round_ratios_beside_predicted_ones():
    control = {
        "independent": [100.0, 200.0, 100.0],
        "chained": [150.0, 240.0, 130.0],
        "unchunked": [120.0, 200.0, 100.0],
    }
    predicted = {
        "independent": _readings(1.0, 0.5, 1.0, 2.0),
        "chained": _readings(1.5, 0.6, 1.5, 2.0),
        "unchunked": _readings(2.0, 0.5, 2.0, 2.0),
    }
    lines = simulator_validation.control_table(control, predicted)
    (chained,) = [line for line in lines if line.startswith("| chained / independent")]
    # Per round 1.5, 1.2, 1.3: median 1.3 [1.2-1.5]; predicted 1.5, 1.2, 1.5 and 1.0.
    assert chained == (
        "| chained / independent | 1.300 [1.200-1.500] | 1.500 | 1.200 | 1.500 | 1.000 |"
    )
    (independent,) = [line for line in lines if line.startswith("| independent |")]
    assert independent == (
        "| independent | 100.0 [100.0-200.0] | 1000.0 | 500.0 | 1000.0 | 2000.0 |"
    )


def test_schedule_table_gives_each_reading_its_error_and_speedup():
    def row(schedule, step, speedup):
        return {
            "schedule": schedule,
            "step_s": step,
            "step_min_s": step,
            "step_max_s": step,
            "speedup": speedup,
            "speedup_min": speedup,
            "speedup_max": speedup,
        }

    measured = {"schedules": [row("none", 2.0, 1.0), row("lancet", 1.6, 1.25)]}
    predicted = {
        "none": _readings(2.2, 2.0, 2.0, 2.2),
        "lancet": _readings(1.76, 1.6, 1.2, 2.4),
    }
    lines = simulator_validation.schedule_table(measured, predicted)
    (lancet,) = [line for line in lines if line.startswith("| lancet |")]
    cells = [cell.strip() for cell in lancet.strip("|").split("|")]
    assert cells[3:6] == ["1760.0", "+10.0%", "1.250"]  # 1.76 / 1.6 - 1; 2.2 / 1.76
    assert cells[6:9] == ["1600.0", "+0.0%", "1.250"]
    assert cells[-3:] == ["2400.0", "+50.0%", "0.917"]
    assert simulator_validation.worst_error(measured, predicted) == pytest.approx(0.1)
    assert simulator_validation.worst_error(measured, predicted, "scaled") == pytest.approx(0.0)


def test_compute_only_comes_from_the_run_or_from_a_full_run_of_the_same_step(tmp_path):
    def report(compute):
        return {"schedules": [{"schedule": "none", "compute_only_s": compute}]}

    assert simulator_validation.compute_only(report(1.5), None) == 1.5
    full = tmp_path / "full.json"
    full.write_text(json.dumps(report(1.25)))
    assert simulator_validation.compute_only(report(float("nan")), full) == 1.25
    with pytest.raises(ValueError, match="--compute-only-from"):
        simulator_validation.compute_only(report(float("nan")), None)


def test_the_regime_runs_every_all_to_all_on_sockets_with_none_first(tmp_path: Path):
    request = overlap_regime.request(sweep=tmp_path / "c")
    config = request.check()
    assert request.experimental.transport == "socket"  # a research option, not a setting
    assert config.schedule.transport == "xla"
    assert request.schedules[0] == "none"
    assert (request.hosts, request.devices_per_host) == (2, 1)
    assert (config.parallel.data, config.parallel.expert) == (1, 2)
    assert request.sweep == tmp_path / "c"
    assert not request.shaped_only  # the breakdown needs the step on the unshaped link
    assert request.control  # the control runs beside the schedules
    quick = overlap_regime.request(quick=True)
    assert quick.shaped_only and (quick.repeats, quick.warmup) == (3, 1)
    fast = overlap_regime.request(link_mbit=200, shaped_only=True)
    assert fast.link_mbit == 200 and fast.shaped_only
    assert "--link-mbit 200 " in fast.command()
    assert "--experimental.link_mbit 200" in fast.command()
    assert fast.experimental.link_mbit == 200


def test_summary_gives_calibration_control_and_breakdown():
    report = {
        "link_calibration": {
            "passed": True,
            "message_bytes": 2**20,
            "rate_fraction": 0.957,
            "rate_mbit": 50.0,
            "pieces": 8,
            "pieces_ratio": 0.984,
        },
        "overlap_control": {
            "independent": [380.0, 390.0],
            "chained": [480.0, 500.0],
            "unchunked": [470.0, 490.0],
            "chained_over_independent": [1.2, 1.3],
            "overlap_shown": True,
        },
        "schedules": [{"schedule": "none", "step_s": 8.0, "compute_only_s": 2.0}],
        "communication_only_s": 7.5,
        "machine": "x86_64, 2 CPU cores",
    }
    text = overlap_regime.summary(report)
    assert "calibrated: a 1.00 MiB message at 95.7% of 50 Mbit/s" in text
    assert "chained / independent 1.250 at the median (overlap shown)" in text
    assert "communication is 75% of it" in text
    report["schedules"][0]["compute_only_s"] = float("nan")  # a --shaped-only run
    assert "unshaped" not in overlap_regime.summary(report)


def test_other_schedules_reach_the_cluster_and_their_planning_is_reported():
    schedules = ("none", "comet", "lancet+comet")
    request = overlap_regime.request(schedules=schedules)
    assert "--schedules none,comet,lancet+comet" in request.command()
    planned = {
        "none": {"partitions": [], "exchanges": []},
        "lancet": {"partitions": ["ops 0-9 in 8 chunks"], "exchanges": []},
        "comet": {"partitions": [], "exchanges": ["layer_1/moe chunks:2"]},
    }
    assert simulator_validation._planning_lines(planned) == [
        "Forward ranges partitioned by the run's own planning: lancet: ops 0-9 in 8 chunks.",
        "MoE layers by the run's own planning: comet: layer_1/moe chunks:2.",
    ]
