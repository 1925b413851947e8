"""The emulated-cluster command: what it refuses, and that ``--calibrate`` checks nothing
of the training layout (the measurement is tested in emulation/test_schedule_runs.py, the
network in emulation/test_network.py; full runs are measurements, in experiments/results/)."""

import json

import experiments.cluster as cluster
from experiments.emulation.link_calibration import LinkCalibration


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
    assert cluster.main(["--link-mbit", "-5"]) == 2
    assert "rate_mbit must be a positive" in capsys.readouterr().err


def test_calibrate_checks_only_the_link(monkeypatch, tmp_path, capsys):
    """One device per host does not fill the default layout's 8 devices: --calibrate
    does not care (it trains nothing)."""
    measured = []

    def calibrate_hosts(hosts, link):
        measured.append((hosts, link.rate_mbit))
        return LinkCalibration(200.0, 4096, 50.0, 2_500_000, 8, 1, 0.03, [0.105], [0.106])

    monkeypatch.setattr(cluster, "namespaces_available", lambda: (True, "root"))
    monkeypatch.setattr(cluster, "calibrate_hosts", calibrate_hosts)
    out = tmp_path / "calibration.json"
    argv = ["--calibrate", "--hosts", "2", "--devices-per-host", "1", "--link-mbit", "200"]
    assert cluster.main([*argv, "--json", str(out)]) == 0
    assert measured == [(2, 200.0)]
    report = json.loads(out.read_text())
    assert report["passed"] and report["command"].startswith("python -m experiments.cluster")
    assert "link calibration (calibrated)" in capsys.readouterr().out
    assert cluster.main(["--calibrate", "--link-mbit", "0"]) == 2
    assert "rate_mbit must be a positive" in capsys.readouterr().err


def test_the_command_line_is_the_request():
    args, overrides = cluster._parse(
        ["--schedules", "none,dw", "--schedule", "lancet", "--shaped-only", "--moe.top_k", "2"]
    )
    request = cluster.request_from(args, overrides)
    assert request.schedules == ("none", "dw", "lancet")
    assert request.shaped_only and request.control and request.overrides == ("--moe.top_k", "2")
    again = cluster.request_from(*cluster._parse(request.cluster_argv()))
    assert again == request
