"""The evaluation's paper-scale configurations and its tables."""

import pytest

from experiments import lancet_eval


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
