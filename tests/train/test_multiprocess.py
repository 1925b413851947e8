"""Multi-process runs: real processes joined by gloo collectives on loopback."""

import json
import subprocess
import sys
import time
from pathlib import Path

from jaxmoe.parallel.distributed import PEER_FAILURE_SIGNS
from jaxmoe.train.launch import LAUNCH_FAILURE_MESSAGE, child_environment, free_port, launch

SMALL = ["--model.num_layers", "2", "--model.d_model", "64", "--data.max_bytes", "300000"]
SMALL += ["--no-progress", "--train.eval_every", "1000"]


def jaxmoe(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxmoe.train.cli", *args]


def losses(run_dir: Path) -> list[float]:
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["loss"] for row in rows]


def test_two_processes_train_like_one(tmp_path):
    single, double = tmp_path / "one", tmp_path / "two"
    common = ["--steps", "5", *SMALL]
    one = subprocess.run(
        jaxmoe("train", *common, "--out", str(single)),
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        jaxmoe("launch", "-n", "2", "--", "train", *common, "--out", str(double)),
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert two.returncode == 0, two.stdout[-3000:]
    assert "[host 0] done: 5 steps" in two.stdout
    assert "[host 1] done" not in two.stdout  # only process 0 reports and writes
    single_losses, double_losses = losses(single), losses(double)
    assert len(double_losses) == 5
    for a, b in zip(single_losses, double_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (single_losses, double_losses)


def test_killing_one_process_stops_the_other_within_the_bound(tmp_path):
    port = free_port()
    common = ["train", "--steps", "5000", *SMALL, "--heartbeat-timeout", "10"]
    common += ["--step-timeout", "60", "--coordinator", f"127.0.0.1:{port}"]
    out = tmp_path / "run"
    common += ["--num-processes", "2", "--out", str(out)]  # every process writes checkpoints
    survivor = subprocess.Popen(
        jaxmoe(*common, "--process-id", "0"),
        env=child_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = subprocess.Popen(
        jaxmoe(*common, "--process-id", "1"),
        env=child_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, "training did not start"
            assert survivor.poll() is None and victim.poll() is None
            time.sleep(0.5)
        victim.kill()
        killed = time.monotonic()
        _, stderr = survivor.communicate(timeout=90)
        stopped_after = time.monotonic() - killed
    finally:
        for process in (survivor, victim):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert survivor.returncode != 0
    assert stopped_after < 70, stopped_after  # heartbeat 10 s; step watchdog 60 s
    assert any(sign in stderr for sign in PEER_FAILURE_SIGNS), stderr[-2000:]


def test_launcher_names_the_failed_process(capsys):
    def fail_second(index: int, argv: list[str]) -> list[str]:
        return argv if index == 0 else [sys.executable, "-c", "import sys; sys.exit(7)"]

    status = launch(["train", "--steps", "2", *SMALL], 2, wrap=fail_second, grace_s=2)
    assert status == 1
    assert LAUNCH_FAILURE_MESSAGE.format(index=1, status=7) in capsys.readouterr().out
