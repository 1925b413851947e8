"""Link calibration: its criteria on given figures, and on real shaped links (needs root)."""

from __future__ import annotations

import json

import pytest

import experiments.cluster as cluster
from experiments.emulation import link_calibration, network
from experiments.emulation.link_calibration import (
    LinkCalibration,
    LinkNotCalibrated,
    calibrate_link,
    calibrated_network,
    ensure_calibrated,
)
from experiments.emulation.network import EmulatedNetwork, LinkShape, namespaces_available


def _calibration(message_s: float, pieces_s: float) -> LinkCalibration:
    # 2.5 MB at 200 Mbit/s: 100 ms at line rate.
    return LinkCalibration(
        rate_mbit=200.0,
        bucket_bytes=4096,
        queue_latency_ms=50.0,
        message_bytes=2_500_000,
        pieces=8,
        repeats=3,
        gap_s=0.03,
        message_s=[message_s + 0.002, message_s, message_s + 0.001],
        pieces_s=[pieces_s] * 3,
    )


def test_a_link_at_line_rate_whose_pieces_cost_the_same_passes():
    calibration = _calibration(0.105, 0.106)
    assert calibration.rate_fraction == pytest.approx(0.1 / 0.105)
    assert calibration.passed and calibration.to_dict()["problems"] == []


def test_pieces_faster_than_the_whole_fail_as_a_bucket_effect():
    # The figures of the old 10 ms bucket: pieces at nearly twice the line rate.
    problems = _calibration(0.105, 0.056).problems()
    assert len(problems) == 1 and "bucket lets pieces out above line rate" in problems[0]


def test_a_link_short_of_its_rate_fails():
    (problem,) = _calibration(0.125, 0.125).problems()
    assert "80.0% of 200 Mbit/s" in problem and "--link-mbit" in problem


def test_an_uncalibrated_link_is_refused_unless_allowed(capsys):
    failing = _calibration(0.105, 0.056)
    assert not ensure_calibrated(failing, allow_uncalibrated=False)
    assert "refusing to run" in capsys.readouterr().err
    assert ensure_calibrated(failing, allow_uncalibrated=True)
    assert "WARNING: the link is NOT calibrated" in capsys.readouterr().err


def test_message_size_and_sweep():
    size = link_calibration.message_bytes_for(200.0)
    assert size % (8 * 4096) == 0 and abs(size - 2_500_000) < 8 * 4096
    assert link_calibration.sweep_sizes(size)[:3] == [16384, 65536, 262144]
    assert link_calibration.sweep_sizes(size)[-1] == size


_AVAILABLE, _REASON = namespaces_available()
needs_namespaces = pytest.mark.skipif(not _AVAILABLE, reason=_REASON)


@needs_namespaces
def test_the_shaped_link_is_calibrated():
    # Whether the calibration passes depends on how busy the host is (a test asserts no
    # timing); what cannot depend on it is the cap: the shaper never lets the link run
    # faster than its rate, while the unshaped veth pair runs at Gbit/s.
    with EmulatedNetwork(2, LinkShape(rate_mbit=200)) as network:
        calibration = calibrate_link(network)
    assert 0 < calibration.rate_fraction <= 1.05, calibration.summary()
    assert calibration.passed == (not calibration.problems()), calibration.summary()
    assert [point["bytes"] for point in calibration.sweep][:3] == [16384, 65536, 262144]


@needs_namespaces
def test_a_large_bucket_fails_calibration(monkeypatch):
    # The bucket the cluster had before: 10 ms of line rate refills between pieces.
    monkeypatch.setattr(network, "TBF_BURST_SECONDS", 0.01)
    with EmulatedNetwork(2, LinkShape(rate_mbit=200)) as shaped:
        calibration = calibrate_link(shaped, message_bytes=1 << 20, repeats=2)
    assert calibration.pieces_ratio < 0.95, calibration.summary()
    assert not calibration.passed


@needs_namespaces
def test_cluster_calibrate_writes_its_figures(tmp_path, capsys):
    # One device per host: --calibrate checks no training layout.
    out = tmp_path / "calibration.json"
    argv = ["--calibrate", "--hosts", "2", "--devices-per-host", "1", "--link-mbit", "200"]
    status = cluster.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    # Whether it passes depends on the host's load; the exit status must say which.
    assert status == (0 if report["passed"] else 1)
    verdict = "calibrated" if report["passed"] else "NOT CALIBRATED"
    assert f"link calibration ({verdict})" in capsys.readouterr().out
    assert 0 < report["rate_fraction"] <= 1.05
    assert report["command"].endswith(f"--json {out}")
    assert len(report["message_s"]) == report["repeats"]


@needs_namespaces
def test_an_uncalibrated_link_is_refused_before_anything_runs_on_it(monkeypatch, capsys):
    failing = _calibration(0.105, 0.056)
    monkeypatch.setattr(link_calibration, "calibrate_link", lambda network: failing)
    with (
        pytest.raises(LinkNotCalibrated, match="bucket"),
        calibrated_network(2, LinkShape(rate_mbit=200)),
    ):
        raise AssertionError("ran on an uncalibrated link")
    assert "refusing to run experiments" in capsys.readouterr().err
    with calibrated_network(2, LinkShape(rate_mbit=200), allow_uncalibrated=True) as (_, found):
        assert found is failing
    assert cluster.main(["--steps", "1"]) == 3  # the cluster's measurement goes through it
