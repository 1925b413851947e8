"""The evaluation's paper-scale configurations and its tables."""

import functools

import pytest

from experiments import lancet_eval
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step
from scheduling import (
    SchedulePolicy,
    batch_inputs,
    cost_model,
    estimate,
    exposed_all_to_all,
    schedule,
)


@pytest.mark.parametrize(("layers", "width", "gpus"), [(12, 768, 16), (24, 1024, 32)])
def test_paper_configurations(layers, width, gpus):
    config = lancet_eval.paper_config(layers, width, gpus)
    assert config.moe.num_experts == 2 * gpus
    assert (config.moe.top_k, config.moe.capacity_factor) == (1, 1.0)
    assert (config.model.num_heads, config.model.seq_len, config.model.moe_every) == (16, 512, 2)
    assert config.parallel.num_devices == gpus
    assert len(config.model.moe_layers) == layers // 2


def test_table_compares_each_schedule_with_none():
    def row(schedule, step, exposed):
        return {
            "config": "c",
            "schedule": schedule,
            "step_s": step,
            "compute_s": 1.0,
            "communication_s": 0.5,
            "exposed_s": exposed,
            "all_to_all_exposed_s": exposed,
        }

    lines = lancet_eval._table([row("none", 2.0, 0.8), row("lancet", 1.25, 0.1)])
    (lancet,) = [line for line in lines if "| lancet |" in line]
    assert "| 88% |" in lancet  # 1 - 0.1 / 0.8
    assert "| 1.600x |" in lancet
    assert lancet.endswith("| 1.25 |")  # 1.25 / max(1.0, 0.5)


def test_table_leaves_unmeasured_cluster_figures_out():
    # --quick runs the cluster on the shaped link only: no compute-only, so no exposed
    # communication and no bound.
    nan = float("nan")
    rows = [
        {"config": "c", "schedule": name, "step_s": step, "compute_s": nan,
         "communication_s": 1.8, "exposed_s": nan}
        for name, step in (("none", 2.0), ("lancet", 1.6))
    ]  # fmt: skip
    (lancet,) = [line for line in lancet_eval._table(rows) if "| lancet |" in line]
    assert lancet == "| c | lancet | 1600.00 | n/a | n/a | n/a | 1.250x | n/a |"


def _step_and_exposed_all_to_all(program, policy, cost, batch):
    scheduled = schedule(program, policy, cost, batch)
    timeline = estimate(scheduled.graph, scheduled.order, cost)
    return timeline.step_seconds, exposed_all_to_all(scheduled.graph, timeline)


@functools.cache
def _paper_program():
    """The paper's model family (GPT-2 MoE, sequence 512, top-1, capacity 1.0), cut to 4
    layers of width 128 on the 8 test devices so that planning takes seconds: its mesh,
    captured step and batch inputs, captured once for every profile."""
    config = lancet_eval.paper_config(4, 128, 8)
    mesh = build_mesh(config.parallel)
    program, sharded = capture_train_step(resolve(config, mesh))
    return mesh, program, batch_inputs(program, sharded.batch_argnums)


@pytest.mark.parametrize("profile", lancet_eval.PROFILES)
def test_lancet_is_never_estimated_worse_than_its_parts_on_a_paper_model(profile):
    mesh, program, batch = _paper_program()
    ranks = {}
    for name in ("async", "dw", "partition", "lancet"):
        policy = SchedulePolicy(name=name, profile=profile)
        ranks[name] = _step_and_exposed_all_to_all(program, policy, cost_model(policy, mesh), batch)
    for part in ("async", "dw", "partition"):
        assert ranks["lancet"] <= ranks[part], (part, ranks)


def _simulated_rows(text):
    section = text[text.index("## (b)") :]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| gpt2")]
    return {(cells[0].lstrip("| "), cells[1]): float(cells[2]) for cells in rows}


def test_results_have_lancet_no_slower_than_partition_or_dw_in_every_simulated_row():
    steps = _simulated_rows((lancet_eval.RESULTS / "lancet_eval.md").read_text())
    configs = {config for config, _ in steps}
    assert configs
    for config in configs:
        lancet = steps[config, "lancet"]
        assert lancet <= min(steps[config, "partition"], steps[config, "dw"]), config
