"""Checkpoints across process counts: a two-process run preempted, resumed by one process."""

import subprocess
import sys
import time

from jaxmoe.cli.launch import child_environment
from jaxmoe.cli.main import main
from jaxmoe.exit_codes import PREEMPTED
from jaxmoe.train.checkpoint import latest_checkpoint
from jaxmoe.train.logs.metrics import read_rows

from .test_multiprocess import LONG, SMALL


def jaxmoe(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxmoe.cli", *args]


def test_a_preempted_two_process_run_resumes_in_one_process(tmp_path, capsys):
    # Enough steps that the agreed stop (a step or two after the signal) comes before the
    # end; the step of tests/train/test_multiprocess.py's runs (see LONG there). The
    # uninterrupted run in this process.
    common = ["--steps", str(LONG), *SMALL]
    assert main(["train", *common, "--out", str(tmp_path / "single")]) == 0

    out = tmp_path / "two"
    launcher = subprocess.Popen(
        jaxmoe("launch", "-n", "2", "--", "train", *common, "--out", str(out)),
        env=child_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while len(read_rows(out / "metrics.jsonl")) < 2:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.02)
    # The cluster preempts one process: JAX's preemption service stops both after the same
    # step, each writes its shards of the checkpoint, and the launcher reports it.
    worker = subprocess.run(["pgrep", "-f", f"out {out} .*--process-id 1"], capture_output=True)
    subprocess.run(["kill", "-TERM", *worker.stdout.split()], check=True)
    output, _ = launcher.communicate(timeout=180)
    assert launcher.returncode == PREEMPTED, output[-3000:]
    assert "stopped on a signal after writing a checkpoint" in output
    saved = latest_checkpoint(out)
    assert saved is not None and 2 <= saved < LONG

    capsys.readouterr()  # resumed by one process: this one
    assert main(["train", *common, "--out", str(out), "--resume"]) == 0
    assert f"resuming from the checkpoint of step {saved}" in capsys.readouterr().out
    expected, rows = (
        read_rows(tmp_path / "single" / "metrics.jsonl"),
        read_rows(out / "metrics.jsonl"),
    )
    assert [row["step"] for row in rows] == list(range(LONG))
    for a, b in zip(expected, rows, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (expected, rows)
