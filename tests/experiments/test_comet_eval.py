"""The COMET evaluation's single-layer program and its reading of the targets."""

from experiments import comet_cluster, comet_eval
from scheduling import SchedulePolicy, build_report, cost_model, schedule


def test_single_layer_program_has_both_exchanges_and_comet_never_loses():
    program, mesh = comet_eval.layer_program(width=16, hidden=32, experts=8, top_k=2, gpus=8)
    all_to_alls = [op.phase.value for op in program.ops if op.primitive == "all_to_all"]
    assert all_to_alls == ["forward", "forward", "backward", "backward"]
    policy = SchedulePolicy(name="comet", profile="a100-8x-nvlink-400g")
    cost = cost_model(policy, mesh)
    scheduled = schedule(program, policy, cost, [program.inputs[-2]])
    report = build_report(scheduled, cost, policy, program)
    (layer,) = report.exchanges
    assert layer.phases == ["forward", "backward"]
    assert report.step_seconds <= report.baseline_step_seconds


def test_targets_read_the_rows():
    layers = [
        {"config": "c", "schedule": "none", "layer_s": 3.0},
        {"config": "c", "schedule": "tutel-2", "layer_s": 2.5},
        {"config": "c", "schedule": "comet", "layer_s": 2.0},
    ]
    steps = [
        {"config": "s", "schedule": name, "step_s": seconds}
        for name, seconds in (("none", 4.0), ("lancet", 3.0), ("comet", 3.5), ("lancet+comet", 3.0))
    ]
    (layer_line, step_line) = comet_eval._targets(layers, steps)
    assert "comet 1.500x over none (meets 1.5x)" in layer_line and "beats it" in layer_line
    assert "never slower than either alone" in step_line


def test_skipped_parts_are_kept_from_the_file_they_overwrite(tmp_path):
    out = tmp_path / "comet_eval.md"
    out.write_text(
        "# COMET evaluation\n\n## (a) One layer\n\nA rows\n\n## (b) End to end\n\nB rows\n\n"
        "## (c) Emulated cluster\n\nC rows\n\n## Targets\n\n- T line\n"
    )
    argv = ["--skip-simulator", "--skip-cluster", "--out", str(out)]
    assert comet_eval.main(argv) == 0
    text = out.read_text()
    for kept in ("A rows", "B rows", "C rows", "- T line"):
        assert text.count(kept) == 1, kept
    assert text.index("B rows") < text.index("C rows") < text.index("- T line")
    assert "--skip-simulator --skip-cluster" in text


def test_the_cluster_part_sets_measured_beside_predicted_speedups():
    measured = {
        "schedules": [
            {"schedule": "none", "step_rounds_s": [2.0, 2.2]},
            {"schedule": "comet", "step_rounds_s": [1.0, 2.0]},
        ]
    }
    reading = {"instrument": 1.0, "scaled": 0.5, "all_async": 0.8}

    def readings(factor):
        return {key: {"step_s": value * factor} for key, value in reading.items()}

    predicted = {"schedules": {"none": readings(1.0), "comet": readings(0.8)}}
    (header, _, line) = comet_cluster.comparison(measured, predicted)
    assert header.startswith("Measured against predicted")
    assert line == (
        "- comet: measured 1.550 [1.100-2.000]; predicted 1.250 (instrument), "
        "1.250 (compute scaled), 1.250 (every collective asynchronous)"
    )
