"""Placement on the emulated cluster: the refusals and the results file (the per-host
rounds are tested in emulation/test_placement_rounds.py; full runs are measurements, in
experiments/results/placement_cluster.md)."""

import experiments.placement_cluster as placement_cluster
from jaxmoe.cli.parser import config_from_train_args


def test_refuses_a_run_without_replica_slots(capsys):
    argv = ["--moe.slots_per_device", "1", "--moe.rebalance_every", "0"]
    assert placement_cluster.main(argv) == 2
    assert "--moe.slots_per_device above the experts per device" in capsys.readouterr().err


def test_refuses_a_layout_that_does_not_fill_the_hosts_and_a_missing_directory(tmp_path, capsys):
    assert placement_cluster.main(["--hosts", "2", "--devices-per-host", "2"]) == 2
    assert "2 hosts x 2 devices = 4" in capsys.readouterr().err
    assert placement_cluster.main(["--out", str(tmp_path / "missing" / "out.md")]) == 2
    assert "does not exist" in capsys.readouterr().err


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
