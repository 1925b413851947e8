"""The dropless evaluation's pure parts: the load figures, the planner's replays, and the
results file read off a saved run (full runs are measurements, in
experiments/results/dropless_eval.md). Nothing is compiled."""

import numpy as np
import pytest

from experiments import dropless_eval, dropless_placement, dropless_report, dropless_variants
from jaxmoe.placement.routing_history import SMOOTHING

STEPS = 12


def test_excess_load_is_the_largest_over_the_mean_less_one_per_layer():
    loads = np.array([[1.0, 1.0, 2.0, 0.0], [3.0, 1.0, 1.0, 3.0]])
    assert dropless_placement.excess_load(loads) == pytest.approx((1.0 + 0.5) / 2)


def test_persistence_reads_an_autoregressive_series():
    rng = np.random.default_rng(0)
    steps, experts, phi = 4000, 8, 0.7
    deviation = np.zeros((steps, 1, experts))
    for step in range(1, steps):
        deviation[step] = phi * deviation[step - 1] + rng.normal(size=(1, experts))
    rows = [{"tokens_per_expert": 1000.0 + 10.0 * value} for value in deviation]
    correlation = dropless_placement.persistence(rows)
    assert correlation["1"] == pytest.approx(phi, abs=0.05)
    assert correlation["5"] == pytest.approx(phi**5, abs=0.05)


def _routing(dropless: bool) -> list[dict]:
    """Steps of skewed routing on ``tiny``'s 2 MoE layers x 8 experts (1 copy kept, for
    capacity, what fits in one copy's places)."""
    rng = np.random.default_rng(1)
    rows = []
    for step in range(STEPS):
        load = rng.poisson([400, 300, 200, 150, 100, 50, 50, 30], size=(2, 8)).astype(float)
        row = {"step": step, "tokens_per_expert": load}
        if not dropless:
            places = 160.0
            row["kept_by_copies"] = np.minimum(load[..., None], places * np.arange(1, 9))
        rows.append(row)
    return rows


@pytest.mark.parametrize("dropless", [True, False])
def test_replays_plan_before_each_step_and_hindsight_does_best(dropless):
    config = dropless_placement.placement_config(STEPS, 1, dropless)
    options = dropless_placement.placement_options(dropless, "round_robin")

    def replay(mode, smoothing=None):
        return dropless_placement.replay(rows, config, mode, smoothing, options)

    rows = _routing(dropless)
    modes = [mode for mode in dropless_placement.REPLAYS if dropless or mode != "fitted"]
    figures = {mode: np.mean(replay(mode)[1:]) for mode in modes}
    assert figures["hindsight"] <= min(figures.values()) + 1e-9
    assert figures["smoothed"] < 0.7 * figures["static"]
    swept = replay("smoothed", SMOOTHING["tokens_per_expert"])
    np.testing.assert_allclose(swept, replay("smoothed"))


def _dispatch(scale: float) -> dict:
    figures = {
        "a2a_bytes": 4 * 2**20,
        "count_bytes": 1024.0,
        "bound_rows": None,
        "compiled_flops": 2e9,
        "temp_bytes": 2**20,
        "argument_bytes": 2**20,
        "output_bytes": 2**20,
        "compile_s": 1.0,
        "seconds": [0.1, 0.2],
        "routed_bytes": 5 * 2**20,
        "expert_flops_gemm": 1e9,
        "expert_flops_cpu": 1e9,
        "dropped_fraction": 0.1,
        "max_over_mean_load": 1.5,
    }
    return {
        "capacity 1.25": figures,
        "padded dropless": {**figures, "routed_bytes": 16 * 2**20, "dropped_fraction": 0.0},
        "ragged dropless": {
            **figures,
            "routed_bytes": scale * 5 * 2**20,
            "seconds": [0.2, 0.2],
            "bound_rows": 2048,
        },
        "ragged dropless, 2x buffer": {**figures, "bound_rows": 1024},
    }


def _placement(static: float, dynamic: float) -> dict:
    return {
        "static": static,
        "dynamic": dynamic,
        "static_whole": static,
        "dynamic_whole": dynamic,
        "blocks": [dynamic / static] * 5,
        "replay_blocks": [dynamic / static] * 5,
        "changes_applied": 3,
        "largest_dropped": 0.0,
        "loss_static": 2.0,
        "loss_dynamic": 2.0,
        "replay": {
            "static": static,
            "smoothed": dynamic,
            "last": static,
            "mean": static,
            "fitted": dynamic,
            "hindsight": 0.01,
        },
        "sweep": [[h, w, dynamic + w / 100] for h, w in dropless_placement.SMOOTHING_GRID],
        "persistence": {"1": 0.8, "5": 0.1, "20": 0.0},
    }


def test_the_results_file_reads_the_targets_off_a_saved_run(tmp_path):
    socket = {
        "devices_per_process": 4,
        "variants": {
            name: {
                "seconds": [1.0, 1.0],
                "remote": [8.0 * 2**20] * 2,
                "remote_whole": [8.0 * 2**20] * 2,
            }
            for name in dropless_variants.VARIANTS
        },
    }
    socket["variants"]["ragged dropless"]["remote"] = [4.8 * 2**20] * 2
    result = {
        "host": "x86_64, 2 CPU cores",
        "commands": {"dispatch": "python -m experiments.dropless_eval --steps 2"},
        "dispatch": {"mixtral-tiny": _dispatch(0.8), "deepseek_v3-tiny": _dispatch(1.2)},
        "presets": {
            "mixtral-tiny": {"num_experts": 8, "top_k": 2},
            "deepseek_v3-tiny": {"num_experts": 32, "top_k": 4},
        },
        "steps": 1,
        "repeats": 2,
        "warm_steps": 0,
        "sockets": {
            "measured": {"mixtral-tiny": socket},
            "calibration": None,
            "link_mbit": None,
            "rounds": 2,
            "warm_steps": 0,
        },
        "placement": {"dropless": _placement(0.3, 0.12), "capacity": _placement(0.2, 0.15)},
        "placement_steps": 300,
    }
    out = tmp_path / "dropless_eval.md"
    text = dropless_report.write_report(result, out)
    assert "Command (dispatch): `python -m experiments.dropless_eval --steps 2`" in text
    assert "moves 0.800x the bytes of capacity 1.25" in text and "<= 1.1: met" in text
    assert "moves 1.200x the bytes of capacity 1.25" in text and "<= 1.1: missed" in text
    # Each round's ratio: 0.2 / 0.1 and 0.2 / 0.2.
    assert "| ragged dropless | 200.0 [200.0-200.0] | 1.500 [1.000-2.000] |" in text
    assert "sent 0.600x the bytes of capacity 1.25 to the other host" in text
    assert "dropless excess load 0.400x, met; capacity-mode drops 0.750x, missed" in text
    saved = tmp_path / "saved.json"
    saved.write_text(out.with_suffix(".json").read_text())
    again = tmp_path / "again.md"
    assert dropless_eval.main(["--from", str(saved), "--out", str(again)]) == 0
    assert again.read_text() == text
