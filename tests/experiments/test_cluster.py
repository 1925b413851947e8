"""The emulated-cluster entry point: its refusals and its table (the network itself is
tested in test_netns.py; full runs are measurements, in experiments/results/)."""

import dataclasses
import json

import experiments.cluster as cluster
from experiments import step_rounds
from jaxmoe.cli.parser import config_from_train_args


def test_refuses_without_namespace_rights(monkeypatch, capsys):
    monkeypatch.setattr(cluster, "namespaces_available", lambda: (False, "not root"))
    assert cluster.main(["--steps", "1"]) == 2
    assert "cannot create network namespaces: not root" in capsys.readouterr().err


def test_refuses_a_layout_that_does_not_fill_the_hosts(capsys):
    assert cluster.main(["--hosts", "2", "--devices-per-host", "2"]) == 2
    assert "2 hosts x 2 devices = 4" in capsys.readouterr().err


def test_refuses_unknown_schedules_and_bad_overrides(capsys):
    assert cluster.main(["--schedules", "none,fast"]) == 2
    assert "['fast'] not among" in capsys.readouterr().err
    assert cluster.main(["--moe.top_k", "99"]) == 2
    assert "moe.top_k=99" in capsys.readouterr().err


def test_results_pair_each_round_with_the_baseline_of_the_same_round():
    # A drift that slows round 1 for both schedules must not show as a speedup range.
    shaped = {"none": [1.0, 2.0, 1.1], "dw": [0.5, 1.0, 0.55]}
    free = {"none": [0.4, 0.5, 0.6], "dw": [0.3, 0.3, 0.3]}
    none, dw = cluster.schedule_results(shaped, free, tokens_per_step=1000)
    assert (none.speedup, none.speedup_min, none.speedup_max) == (1.0, 1.0, 1.0)
    assert dw.speedup == dw.speedup_min == dw.speedup_max == 2.0
    assert (dw.step_s, dw.step_min_s, dw.step_max_s) == (0.55, 0.5, 1.0)
    assert dw.compute_only_s == 0.3 and dw.exposed_communication_s == 0.55 - 0.3
    assert dw.tokens_per_s == 1000 / 0.55 and dw.step_rounds_s == shaped["dw"]


def test_table_reports_spread_and_exposed_communication():
    (row,) = cluster.schedule_results({"none": [0.5, 0.4, 0.6]}, {"none": [0.4]}, 500)
    report = {
        "hosts": 2,
        "devices_per_host": 4,
        "link_mbit": 300.0,
        "delay_ms": 0.0,
        "preset": "tiny",
        "repeats": 3,
        "warmup": 1,
        "machine": "x86_64, 2 CPU cores",
        "communication_only_s": 0.2,
        "communication_only_free_link_s": 0.05,
        "schedules": [dataclasses.asdict(row)],
    }
    table = cluster.format_table(report)
    assert (
        "| none | 500.0 [400.0-600.0] | 1.000 [1.000-1.000] | 400.0 | 200.0 | 100.0 | 0.50 |"
        in (table)
    )
    assert "3 interleaved rounds after 1 untimed" in table and "2 CPU cores" in table
    assert "free link: 50.0 ms" in table


def test_rounds_alternate_their_order():
    assert step_rounds.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert step_rounds.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert step_rounds.round_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_step_rounds_compiles_each_schedule_once_and_times_every_round(tmp_path):
    small = [
        *("--model.num_layers", "2", "--model.seq_len", "16", "--train.batch_size", "8"),
        *("--model.d_model", "32", "--model.d_ff", "64", "--model.num_heads", "2"),
        *("--data.max_bytes", "200000"),
    ]
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config_from_train_args(small).to_dict()))
    out = tmp_path / "rounds.json"
    argv = ["--config", str(config_path), "--schedules", "none,async"]
    assert step_rounds.main([*argv, "--rounds", "3", "--warmup", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["orders"] == [["async", "none"], ["none", "async"], ["async", "none"]]
    assert set(report["compile_s"]) == {"none", "async"}
    for seconds in report["seconds"].values():
        assert len(seconds) == 3 and all(s > 0 for s in seconds)


def test_a_schedule_entry_sets_the_chunk_count():
    config = config_from_train_args([])
    chunked = step_rounds.with_schedule(config, "expert_pipeline:4")
    assert chunked.schedule.name == "expert_pipeline"
    assert chunked.schedule.partition_chunks == 4
    assert step_rounds.with_schedule(chunked, "dw").schedule.partition_chunks is None


def test_collective_sweep_writes_curves_the_scheduler_loads(tmp_path):
    import subprocess
    import sys

    from jaxmoe.cli.launch import child_environment
    from scheduling import CollectiveCurves

    out = tmp_path / "curves.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.collective_sweep",
            "--parallel-data",
            "2",
            "--parallel-expert",
            "4",
            "--out",
            str(out),
            "--max-bytes",
            "65536",
            "--repeats",
            "2",
        ],
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    curves = CollectiveCurves.load(out)
    assert set(curves.curves) == {("all_to_all", 4), ("psum", 2), ("psum", 4), ("psum", 8)}
    for curve in curves.curves.values():
        assert len(curve.sizes) == 3 and all(s > 0 for s in curve.seconds)


def test_schedule_entries_with_a_chunk_count():
    assert cluster.schedule_flags("dw") == ["--schedule", "dw"]
    assert cluster.schedule_flags("expert_pipeline:4") == [
        "--schedule",
        "expert_pipeline",
        "--schedule.partition_chunks",
        "4",
    ]
