"""The cross-microbatch evaluation's emulated-cluster section, from a saved measurement."""

import json

from experiments import cross_microbatch_eval


def _row(schedule, step, compute, speedup):
    return {
        "schedule": schedule,
        "step_s": step,
        "step_min_s": step * 0.9,
        "step_max_s": step * 1.1,
        "compute_only_s": compute,
        "exposed_communication_s": step - compute,
        "tokens_per_s": 1000 / step,
        "speedup": speedup,
        "speedup_min": speedup * 0.95,
        "speedup_max": speedup * 1.05,
    }


def _report():
    return {
        "command": "python -m experiments.cluster --hosts 2",
        "machine": "test",
        "hosts": 2,
        "devices_per_host": 1,
        "link_mbit": 200.0,
        "delay_ms": 0.0,
        "preset": "tiny",
        "repeats": 6,
        "warmup": 2,
        "communication_only_s": 1.5,
        "communication_only_free_link_s": 0.1,
        "schedules": [
            _row("none", 3.0, 1.5, 1.0),
            _row("lancet", 2.7, 1.5, 1.11),
            _row("pair", 2.0, 1.6, 1.5),
        ],
        "overlap_control": {"chained_over_independent": [1.2, 1.3, 1.25], "overlap_shown": True},
    }


def test_the_section_names_the_best_schedule_and_the_targets():
    text = "\n".join(cross_microbatch_eval.cluster_section(_report()))
    assert "Best schedule: `pair`" in text
    assert "target 1.3x: met" in text
    # Exposed communication 0.4 s against 1.5 s: cut by 73%, under the 80% target.
    assert "cut by 73% (target 80%: not met)" in text
    assert "overlap shown" in text and "Command: `python -m experiments.cluster" in text


def test_writing_the_section_keeps_the_simulator_section(tmp_path):
    out = tmp_path / "eval.md"
    out.write_text(
        "# Title\n\nCommand: `python -m experiments.cross_microbatch_eval --gpus 8`\n\n"
        f"{cross_microbatch_eval.SIMULATOR_HEADING}\n\n| a simulated table |\n"
    )
    saved = tmp_path / "cluster.json"
    saved.write_text(json.dumps(_report()))
    cross_microbatch_eval.main(["--cluster-json", str(saved), "--out", str(out)])
    text = out.read_text()
    assert text.index(cross_microbatch_eval.CLUSTER_HEADING) < text.index(
        cross_microbatch_eval.SIMULATOR_HEADING
    )
    assert "| a simulated table |" in text and "Best schedule: `pair`" in text


def test_the_predictions_stand_beside_the_measured_rows():
    def guess(step, exposed):
        return {"traced": {"step_s": step, "exposed_s": exposed}}

    predicted = {"none": guess(3.3, 1.8), "lancet": guess(2.75, 1.2), "pair": guess(2.2, 0.6)}
    lines = cross_microbatch_eval.cluster_section(_report(), predicted)
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
    # none: 3.3 s predicted against 3.0 measured (+10.0%), lancet 3.3 / 2.75 = 1.200x.
    assert "| 3300.0 | +10.0% |" in rows["| none"]
    assert "| 1.200 | 1200.0 |" in rows["| lancet"]
    assert "| 2200.0 | +10.0% |" in rows["| pair"]


def _simulated(config, schedule, step, exposed, ideal):
    return {
        "config": config,
        "schedule": schedule,
        "step_s": step,
        "all_to_all_s": 1.0,
        "all_to_all_exposed_s": exposed,
        "ideal_s": ideal,
    }


def test_the_simulator_section_counts_the_targets_met_from_saved_rows(tmp_path):
    rows = [
        _simulated("A", "none", 2.0, 1.0, 1.2),
        _simulated("A", "pair", 1.4, 0.05, 1.2),  # 95% hidden, 1.43x (bound 1.67x)
        _simulated("B", "none", 1.0, 0.2, 0.95),
        _simulated("B", "pair", 0.98, 0.15, 0.95),  # 25% hidden, bound 1.05x
    ]
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"command": "python -m experiments.x --gpus 8", "rows": rows}))
    out = tmp_path / "eval.md"
    cross_microbatch_eval.main(["--rows-json", str(saved), "--out", str(out)])
    text = out.read_text()
    assert "Command: `python -m experiments.x --gpus 8`" in text
    assert "- A: `pair`, 95% of the exposed all-to-all hidden, 1.429x (bound 1.667x)" in text
    assert "90% hidden: met in 1 of 2 configurations. 1.3x: met in 1 of the 1" in text
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == rows


def test_configurations_simulated_at_once_keep_their_order(monkeypatch):
    """With several jobs the configurations finish out of order; the rows do not."""
    import time

    def fake_call(gpus, function, *args):
        assert function is cross_microbatch_eval.simulate
        ((model, profile),) = args[1]
        time.sleep(0.05 if gpus == 8 else 0.0)  # the first configuration finishes last
        return [{"config": f"{model} {gpus} {profile}"}]

    monkeypatch.setattr(cross_microbatch_eval, "call_with_devices", fake_call)
    runs = {8: [["m", "h100"]], 16: [["a", "a100"], ["b", "v100"]]}
    rows = cross_microbatch_eval.simulate_all(runs, microbatches=4, layers=2, jobs=3)
    assert [r["config"] for r in rows] == ["m 8 h100", "a 16 a100", "b 16 v100"]
