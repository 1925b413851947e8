"""Placement on the emulated cluster: the refusals, the per-host rounds and the results
file (full runs are measurements, in experiments/results/placement_cluster.md)."""

import json

import pytest

import experiments.placement_cluster as placement_cluster
from experiments import placement_rounds
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import ConfigError

SMALL = [
    *("--model.num_layers", "2", "--model.seq_len", "16", "--train.batch_size", "8"),
    *("--model.d_model", "32", "--model.d_ff", "64", "--model.num_heads", "2"),
    *("--data.max_bytes", "200000"),
]


def test_refuses_a_run_without_replica_slots(capsys):
    argv = ["--moe.slots_per_device", "1", "--moe.rebalance_every", "0"]
    assert placement_cluster.main(argv) == 2
    assert "--moe.slots_per_device above the experts per device" in capsys.readouterr().err


def test_refuses_a_layout_that_does_not_fill_the_hosts_and_a_missing_directory(tmp_path, capsys):
    assert placement_cluster.main(["--hosts", "2", "--devices-per-host", "2"]) == 2
    assert "2 hosts x 2 devices = 4" in capsys.readouterr().err
    assert placement_cluster.main(["--out", str(tmp_path / "missing" / "out.md")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_variants_differ_only_in_their_placement():
    config = config_from_train_args(["--moe.slots_per_device", "2", "--moe.rebalance_every", "1"])
    variants = placement_rounds.variant_configs(config)
    assert variants["no replicas"].replica_slots == 0
    assert variants["static"].replica_slots == variants["dynamic"].replica_slots == 1
    assert variants["static"].moe.rebalance_every == 0
    assert variants["dynamic"].moe.rebalance_every == 1
    # Equal buffers: the capacity is sized over the slots, so the bytes are the same.
    assert variants["no replicas"].moe.capacity_factor == variants["static"].moe.capacity_factor
    with pytest.raises(ConfigError, match="replica slots"):
        placement_rounds.variant_configs(config_from_train_args([]))


def test_rounds_time_every_variant_and_replan_only_the_dynamic_one(tmp_path):
    overrides = [*SMALL, "--moe.slots_per_device", "2", "--moe.rebalance_every", "1"]
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config_from_train_args(overrides).to_dict()))
    out = tmp_path / "rounds.json"
    argv = ["--config", str(config_path), "--rounds", "3", "--warmup", "1", "--json", str(out)]
    assert placement_rounds.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["seconds"]) == set(placement_rounds.VARIANTS)
    for name in placement_rounds.VARIANTS:
        assert len(report["seconds"][name]) == 3 and all(s > 0 for s in report["seconds"][name])
        assert all(0 <= d <= 1 for d in report["dropped_fraction"][name])
    # Re-planned after every step from live routing, the dynamic table moves.
    assert len(report["planning_s"]) == len(report["changed_slots"]) == 3
    assert sum(report["changed_slots"]) > 0


def test_the_results_file_pairs_rounds_and_names_the_command():
    shaped = {
        "seconds": {"no replicas": [1.0, 2.0], "static": [1.1, 2.2], "dynamic": [1.2, 2.2]},
        "dropped_fraction": {"no replicas": [0.2, 0.2], "static": [0.2, 0.2], "dynamic": [0.1]},
        "planning_s": [0.01, 0.03],
        "changed_slots": [2, 4],
    }
    free = {**shaped, "seconds": {name: [0.5, 0.5] for name in shaped["seconds"]}}
    config = config_from_train_args(["--moe.slots_per_device", "2", "--moe.rebalance_every", "1"])
    report = {
        "command": "python -m experiments.placement_cluster --repeats 2",
        "machine": "x86_64, 2 CPU cores",
        "link_calibration": {
            "passed": True,
            "message_bytes": 2**20,
            "rate_fraction": 0.95,
            "pieces": 8,
            "pieces_ratio": 0.99,
        },
        "hosts": 2,
        "devices_per_host": 4,
        "link_mbit": 50.0,
        "repeats": 2,
        "warmup": 1,
        "config": config.to_dict(),
        "measured": {"shaped": shaped, "free": free},
    }
    text = "\n".join(placement_cluster.report_lines(report))
    assert "`python -m experiments.placement_cluster --repeats 2`" in text
    assert "| static | 1650.0 [1100.0-2200.0] | 1.100 [1.100-1.100] | 1.000 [1.000-1.000]" in text
    assert "| dynamic | 1700.0 [1200.0-2200.0] | 1.150 [1.100-1.200]" in text
    assert "| 500.0 [500.0-500.0] | 0.1000 |" in text
    assert "20.0 [10.0-30.0] ms per step" in text and "mean 3.0" in text
