"""The traced validation's tables, from a saved measurement and predictions."""

import pytest

from experiments import traced_validation


def _row(schedule, step, speedup):
    return {
        "schedule": schedule,
        "step_s": step,
        "step_min_s": step * 0.9,
        "step_max_s": step * 1.1,
        "compute_only_s": 0.4,
        "speedup": speedup,
        "speedup_min": speedup * 0.95,
        "speedup_max": speedup * 1.05,
    }


def _guess(step):
    reading = {"step_s": step, "exposed_s": step / 2}
    return {
        "traced_step_s": 0.4,
        "traced_compute_s": 0.3,
        "unattributed_s": 0.01,
        "between_ops_s": 0.02,
        "traced_host_s": 0.05,
        "link_s": 1.0,
        **{name: reading for name in traced_validation.model.TRACED_READINGS},
    }


MEASURED = {"schedules": [_row("none", 1.5, 1.0), _row("pair", 1.2, 1.25)]}
PREDICTED = {"none": _guess(1.35), "pair": _guess(1.38)}


def test_errors_and_speedups_are_against_the_measured_step():
    rows = traced_validation.schedule_table(MEASURED, PREDICTED)[2:]
    assert "| 1350.0 | -10.0% | 1.000 |" in rows[0]
    assert "| 1380.0 | +15.0% | 0.978 |" in rows[1]
    assert traced_validation.worst_error(MEASURED, PREDICTED) == pytest.approx(0.15)


def test_the_breakdown_shows_what_each_prediction_is_made_of():
    (row,) = traced_validation.breakdown_table(MEASURED, {"none": _guess(1.35)} | PREDICTED)[2:3]
    assert row == "| none | 400.0 | 400.0 | 300.0 | 10.0 | 20.0 | 50.0 | 1000.0 | 675.0 |"


def test_a_new_run_replaces_its_link_rate_s_section_and_keeps_the_others(tmp_path):
    out = tmp_path / "validation.md"
    out.write_text(
        "# Title\n\nintro\n\n## 200 Mbit/s, 4 microbatches\n\nold 200\n\n"
        "## 50 Mbit/s, 4 microbatches\n\nkept 50\n"
    )
    new = ["## 200 Mbit/s, 4 microbatches", "", "new 200", ""]
    merged = "\n".join(traced_validation.merged_sections(out, new))
    assert merged.index("## 50 Mbit/s") < merged.index("## 200 Mbit/s")
    assert "kept 50" in merged and "new 200" in merged and "old 200" not in merged


def test_the_reading_says_what_the_host_work_changes():
    no_host = {"none": 1.2, "pair": 1.0}  # -20% and -16.7% without the host work
    predicted = {
        name: {**guess, "traced_no_host": {"step_s": no_host[name], "exposed_s": 0.0}}
        for name, guess in PREDICTED.items()
    }
    lines = traced_validation.reading(MEASURED, predicted)
    assert "1 of 2 predictions are below the measured step" in lines[0]
    assert "-20.0% to -16.7%: the host work measured in the step is what brings" in lines[1]
    assert "predicted 0.978 to 0.978, measured (per-round medians) 1.250 to 1.250" in lines[2]
    assert "showed no overlap" in lines[2]
