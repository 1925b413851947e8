"""MFU: the device peak, the ``mfu`` metric of a run, and ``jaxmoe schedule``'s estimate."""

import dataclasses
import json
import math
import re

import jax
import pytest

from jaxmoe.cli.main import main
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import ConfigError, MoEConfig, TrainConfig
from jaxmoe.plan.mfu import datasheet_peak_tflops, mfu_meter
from jaxmoe.plan.model_flops import model_flops
from jaxmoe.prepare import prepare_run
from jaxmoe.train.loop import train
from scheduling import PROFILES
from tests.train.runs import one_layer_config, small_config


@pytest.mark.parametrize(
    ("device_kind", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.5),
        ("NVIDIA H100 80GB HBM3", "float32", 494.5),
        ("NVIDIA H100 PCIe", "bfloat16", 756.5),
        ("NVIDIA H200", "bfloat16", 989.5),
        ("NVIDIA H200 NVL", "float32", 417.5),
        ("NVIDIA A100-SXM4-40GB", "bfloat16", 312.0),
        ("NVIDIA A100 80GB PCIe", "float32", 156.0),
        ("Tesla V100-SXM2-32GB", "bfloat16", 15.7),
        ("Tesla V100-PCIE-16GB", "float32", 14.0),
        ("NVIDIA B200", "bfloat16", 2250.0),
        # Not in the table: no peak rather than a neighbour's.
        ("cpu", "float32", None),
        ("NVIDIA H100 NVL", "bfloat16", None),
        ("NVIDIA GH200 480GB", "bfloat16", None),
        ("NVIDIA GB200", "bfloat16", None),
        ("TPU v4", "bfloat16", None),
    ],
)
def test_datasheet_peaks_match_the_variant_before_the_family(device_kind, dtype, tflops):
    assert datasheet_peak_tflops(device_kind, dtype) == tflops


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_peak_must_be_positive(value):
    with pytest.raises(ConfigError, match=rf"train.peak_tflops={value}: must be > 0"):
        TrainConfig(peak_tflops=value)


def test_on_cpu_mfu_needs_an_explicit_peak():
    device_kind = jax.devices()[0].device_kind
    config = small_config()
    assert mfu_meter(config, 8, device_kind) is None
    given = dataclasses.replace(config, train=dataclasses.replace(config.train, peak_tflops=2.5))
    meter = mfu_meter(given, 8, device_kind)
    assert meter is not None and meter.peak_flops_per_s == 2.5e12
    assert config_from_train_args(["--train.peak_tflops", "2.5"]).train.peak_tflops == 2.5


def test_metrics_have_mfu_from_the_logged_step_time(tmp_path):
    # Capacity factor 0.5 drops at least half the assignments: the mfu must not count them.
    base = one_layer_config(steps=3, peak_tflops=0.01)
    config = dataclasses.replace(base, moe=MoEConfig(num_experts=8, capacity_factor=0.5))
    train(prepare_run(config), tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    flops = model_flops(config)
    for row in rows:
        assert row["dropped_fraction"] >= 0.5
        expected = flops.train_step(row["dropped_fraction"]) / (row["step_time_s"] * 8 * 0.01e12)
        assert math.isclose(row["mfu"], expected, rel_tol=1e-12)
        assert row["mfu"] < flops.train_step() / (row["step_time_s"] * 8 * 0.01e12)


def test_schedule_reports_the_estimated_mfu(tmp_path, capsys):
    argv = ["schedule", "--schedule", "dw", "--model.num_layers", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    line = next(
        text for text in capsys.readouterr().out.splitlines() if text.startswith("estimated MFU")
    )
    found = re.match(
        r"estimated MFU ([\d.e-]+)% \(unscheduled ([\d.e-]+)%, ideal ([\d.e-]+)%\): "
        r"([\d.e+]+) GFLOP .* 8 devices at ([\d.]+) TFLOP/s each \(profile 'a100'\)",
        line,
    )
    assert found, line
    scheduled, unscheduled, ideal, gflop, tflops = map(float, found.groups())
    config = config_from_train_args(["--model.num_layers", "2"])
    flops = model_flops(config).train_step()
    assert math.isclose(gflop, flops / 1e9, rel_tol=1e-5)
    assert tflops * 1e12 == PROFILES["a100"].flops_per_s
    totals = json.loads((tmp_path / "schedule_report.json").read_text())["totals"]
    for printed, seconds in (
        (scheduled, totals["step_seconds"]),
        (unscheduled, totals["baseline_step_seconds"]),
        (ideal, totals["ideal_step_seconds"]),
    ):
        expected = 100 * flops / (seconds * 8 * PROFILES["a100"].flops_per_s)
        assert math.isclose(printed, expected, rel_tol=5e-3), (printed, expected)
    # The ideal step is the simulator's lower bound for any schedule.
    assert ideal >= scheduled


def test_the_estimated_mfu_of_a_bfloat16_model_is_against_the_half_precision_peak():
    from types import SimpleNamespace

    from jaxmoe.plan.mfu import estimated_mfu

    report = SimpleNamespace(step_seconds=1.0, baseline_step_seconds=2.0, ideal_step_seconds=0.5)
    for dtype, profile in (("float32", "a100"), ("bfloat16", "a100")):
        config = config_from_train_args(["--model.dtype", dtype, "--schedule.profile", profile])
        estimate = estimated_mfu(config, report, devices=8)
        expected = 312e12 if dtype == "bfloat16" else 156e12  # A100 dense BF16, TF32
        assert estimate.peak_flops_per_s == expected
        assert estimate.of(1.0) == pytest.approx(model_flops(config).train_step() / (8 * expected))
