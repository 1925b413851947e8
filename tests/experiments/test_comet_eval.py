"""The COMET evaluation's single-layer program and its reading of the targets."""

from experiments import comet_eval
from scheduling.optimize import build_report, cost_model, plan
from scheduling.policy import SchedulePolicy


def test_single_layer_program_has_both_exchanges_and_comet_never_loses():
    program, mesh = comet_eval.layer_program(width=16, hidden=32, experts=8, top_k=2, gpus=8)
    all_to_alls = [op.phase.value for op in program.ops if op.primitive == "all_to_all"]
    assert all_to_alls == ["forward", "forward", "backward", "backward"]
    policy = SchedulePolicy(name="comet", profile="a100-8x-nvlink-400g")
    cost = cost_model(policy, mesh)
    report = build_report(plan(program, policy, cost, [program.inputs[-2]]), cost, policy, program)
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
