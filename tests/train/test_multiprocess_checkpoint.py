"""Checkpoints across process counts: written by two processes, resumed by one."""

import shutil
import subprocess
import sys

from jaxmoe.train.checkpoint import latest_checkpoint
from jaxmoe.train.launch import child_environment
from jaxmoe.train.metrics import read_rows

from .test_multiprocess import SMALL


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxmoe.train.cli", *args],
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_two_processes_save_and_one_process_resumes(tmp_path):
    common = ["--steps", "4", *SMALL, "--train.checkpoint_every", "2"]
    single = run("train", *common, "--out", str(tmp_path / "single"))
    assert single.returncode == 0, single.stderr[-2000:]

    out = tmp_path / "two"
    two = run("launch", "-n", "2", "--", "train", *common, "--out", str(out))
    assert two.returncode == 0, two.stdout[-3000:]
    assert latest_checkpoint(out) == 4
    # As if the run had died after its checkpoint of step 2.
    shutil.rmtree(out / "checkpoints" / "4")
    resumed = run("train", *common, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from the checkpoint of step 2" in resumed.stdout

    expected, rows = (
        read_rows(tmp_path / "single" / "metrics.jsonl"),
        read_rows(out / "metrics.jsonl"),
    )
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    for a, b in zip(expected, rows, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (expected, rows)
