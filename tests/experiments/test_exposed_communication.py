"""The exposed communication by purpose sums to the planner's exposed communication."""

import pytest

from experiments import exposed_communication as exposed_module
from experiments.exposed_communication import ExposedCommunication, exposed_communication
from jaxmoe.cli import parser as cli
from jaxmoe.plan import estimates, tracer
from jaxmoe.plan.layer_extrapolation import MAX_LINE_OPS, block_count, extrapolates
from jaxmoe.plan.mappings import Mapping, with_mapping

PROFILE = "h100-8x-nvlink-3200g"
# The planner tests' model (tests/plan/test_planner.py), two layers or eight (four blocks:
# extrapolated from two- and three-block traces), two devices: one expert group.
TINY = [
    "--preset", "tiny", "--model.d_model", "32", "--model.num_heads", "2", "--model.d_ff",
    "64", "--model.seq_len", "16", "--moe.num_experts", "4", "--train.batch_size", "8",
]  # fmt: skip


@pytest.mark.parametrize("layers", [2, 8])
def test_the_purposes_sum_to_the_planners_exposed_communication(layers):
    flags = [*TINY, "--model.num_layers", str(layers), "--devices", "2", "--profile", PROFILE]
    mapping = Mapping(2, 1, 1, 2, 1, "all_to_all", zero=1)
    config = with_mapping(cli.resolve_config(cli.parse(["plan", *flags])), mapping, 8)
    assert extrapolates(config) == (layers == 8)
    found = exposed_communication(config, "dw", PROFILE)
    _, times = tracer.estimate_mapping(config, ["dw"], PROFILE, estimates.EstimateCache(None))
    step = times["dw"]
    assert step.exposed_communication > 0
    assert found.exposed_seconds == pytest.approx(step.exposed_communication, rel=1e-9)
    assert sum(found.communication.values()) == pytest.approx(step.communication, rel=1e-9)
    assert "expert all_to_all (dispatch)" in found.exposed
    assert found.rows_per_device == 4 and found.partitioned_ranges == 0
    assert ExposedCommunication.from_json(found.to_json()) == found


def test_the_line_runs_through_the_depths_the_planner_chooses(monkeypatch):
    """Where the live-bytes bound withdrew placements at two blocks alone, the planner's
    line runs through three blocks and four (jaxmoe.plan.layer_extrapolation); so does the
    breakdown's; where a step of four blocks would pass MAX_LINE_OPS, through two and three.
    Steps priced from their depth alone, nothing traced: 1 s a block exposed, and 5 s more
    at two blocks."""
    traced = []
    ops_a_block = 0

    def step(config, schedule, profile):
        depth = block_count(config)
        traced.append(depth)
        exposed = depth + (5.0 if depth == 2 else 0.0)
        ops = ops_a_block * depth
        return exposed_module._Step({"x": exposed}, {"x": 2.0 * depth}, 0, depth == 2, ops)

    monkeypatch.setattr(exposed_module, "_traced_step", step)
    flags = [*TINY, "--model.num_layers", "14", "--devices", "2", "--profile", PROFILE]
    mapping = Mapping(2, 1, 1, 2, 1, "all_to_all", zero=1)
    config = with_mapping(cli.resolve_config(cli.parse(["plan", *flags])), mapping, 8)
    assert block_count(config) == 7
    found = exposed_communication(config, "dw", PROFILE)
    assert traced == [2, 3, 4]
    assert found.exposed == {"x": pytest.approx(7.0)}
    assert found.communication == {"x": pytest.approx(14.0)}
    traced.clear()
    ops_a_block = MAX_LINE_OPS // 3 - 1
    found = exposed_communication(config, "dw", PROFILE)
    assert traced == [2, 3]
    assert found.exposed == {"x": pytest.approx(7.0 + 5 * (3.0 - 7.0))}  # its slope, -4 s
