"""The overlap control: its verdict on given rounds, and one real run (needs root)."""

from __future__ import annotations

import json

import pytest

from experiments import overlap_control
from experiments.emulation.network import namespaces_available
from experiments.emulation.overlap_control import ControlProgram, ControlResult, ControlSettings


def _result(independent, chained):
    seconds = {"independent": independent, "chained": chained, "unchunked": [0.3] * 3}
    return ControlResult(seconds, ControlSettings())


def test_overlap_is_shown_only_beyond_the_spread():
    assert _result([0.40, 0.42, 0.41], [0.55, 0.56, 0.54]).overlap_shown
    # Faster in the median, but by less than the rounds spread.
    assert not _result([0.40, 0.52, 0.41], [0.50, 0.56, 0.44]).overlap_shown
    # Beyond the spread in the medians, but one round had chained faster.
    assert not _result([0.30, 0.31, 0.60], [0.62, 0.63, 0.55]).overlap_shown


def test_summary_and_json_carry_every_round_in_milliseconds():
    result = _result([0.40, 0.42, 0.41], [0.55, 0.56, 0.54])
    assert "independent  410.0 [400.0-420.0]" in result.summary()
    assert "overlap shown" in result.summary()
    report = result.to_json()
    assert report["independent"] == pytest.approx([400.0, 420.0, 410.0])
    assert report["chained"] == pytest.approx([550.0, 560.0, 540.0])
    assert report["unchunked"] == pytest.approx([300.0] * 3)
    assert report["chained_over_independent"] == pytest.approx(
        [0.55 / 0.40, 0.56 / 0.42, 0.54 / 0.41]
    )
    assert report["rows_per_device"] == 2048 and report["all_to_all_bytes_per_device"] == 2**22


def test_settings_share_a_cluster_hosts_rows_among_its_devices_and_check_the_chunks():
    assert ControlSettings.for_cluster(2, 1, 50.0, 6, 2).program.rows == 2048
    assert ControlSettings.for_cluster(2, 4, 50.0, 6, 2).program.rows == 512
    assert ControlSettings.for_cluster(3, 1, 50.0, 6, 2).program.rows == 2040  # 85 x 24
    with pytest.raises(ValueError, match="divide into 8 chunks"):
        ControlSettings(ControlProgram(rows=100), hosts=2)
    with pytest.raises(ValueError, match="collectives"):
        ControlProgram(collectives="mpi")


_AVAILABLE, _REASON = namespaces_available()


@pytest.mark.skipif(not _AVAILABLE, reason=_REASON)
def test_a_small_control_runs_on_the_cluster_and_writes_its_rounds(tmp_path, capsys):
    out = tmp_path / "control.json"
    # The link's calibration is tested on its own; a loaded host must not fail this test.
    argv = ["--rows", "64", "--width", "64", "--repeats", "2", "--warmup", "1"]
    argv.append("--allow-uncalibrated")
    assert overlap_control.main([*argv, "--json", str(out)]) == 0
    assert "overlap control (socket all_to_all" in capsys.readouterr().out
    report = json.loads(out.read_text())
    for form in ("independent", "chained", "unchunked"):
        assert len(report[form]) == 2 and all(ms > 0 for ms in report[form])
    assert "pieces_ratio" in report["link_calibration"] and report["command"].endswith(str(out))
    assert report["rows_per_device"] == 64 and report["hosts"] == 2
