"""The emulated-cluster entry point: its refusals and its table (the network itself is
tested in test_netns.py; full runs are measurements, in experiments/results/)."""

import experiments.cluster as cluster


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


def test_table_reports_exposed_communication():
    report = {
        "hosts": 2,
        "devices_per_host": 4,
        "link_mbit": 300.0,
        "delay_ms": 0.0,
        "preset": "tiny",
        "steps": 5,
        "warmup": 1,
        "communication_only_s": 0.2,
        "communication_only_free_link_s": 0.05,
        "schedules": [
            {
                "schedule": "none",
                "step_s": 0.5,
                "compute_only_s": 0.4,
                "exposed_communication_s": 0.1,
                "tokens_per_s": 1000.0,
            }
        ],
    }
    table = cluster.format_table(report)
    assert "| none | 500.0 | 400.0 | 200.0 | 100.0 | 0.50 | 1,000 |" in table
    assert "free link: 50.0 ms" in table


def test_collective_sweep_writes_curves_the_scheduler_loads(tmp_path):
    import subprocess
    import sys

    from jaxmoe.train.launch import child_environment
    from scheduling.link_model import CollectiveCurves

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
        "--train.schedule_partition_chunks",
        "4",
    ]
