"""Multi-process runs: real processes joined by gloo collectives on loopback.

Every run here trains the small model for at most ``LONG`` steps: the tiny preset warms up
over 20 steps and decays over ``max(steps - 1, warmup + 1)`` = 21 steps for any such run,
so they all compile the same step, each process count's once, and read it back from the
persistent compilation cache after. The single-process runs that the multi-process ones
are compared with run in the test's own process: the same program on 8 devices; so does
the launcher, where a test does not signal or time it.
"""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxmoe.cli.launch import child_environment, failure_message, free_port, launch
from jaxmoe.cli.main import main
from jaxmoe.parallel.distributed import PEER_FAILURE_SIGNS

from .runs import ONE_LAYER

# The one-layer model of tests/train/runs.py: what is under test is the processes, not the
# model, and a launch compiles it in seconds.
SMALL = [*ONE_LAYER, "--no-progress", "--train.eval_every", "1000"]
# The most steps whose step is the 5-step run's (above); runs that a test kills are this
# long, so that they are still training when it kills them after their second step (a step
# takes about 0.1 s with two processes).
LONG = 22


def jaxmoe(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxmoe.cli", *args]


def losses(run_dir: Path) -> list[float]:
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["loss"] for row in rows]


def train_here(out: Path, *args: str) -> list[float]:
    """The losses of ``jaxmoe train ARGS --out OUT`` run in this process (8 devices)."""
    assert main(["train", *args, "--out", str(out)]) == 0
    return losses(out)


def launch_here(capsys, *args: str) -> tuple[int, str]:
    """``jaxmoe launch -n 2 -- train ARGS`` with the launcher in this process (its two
    processes started as from the command line): its status and output."""
    capsys.readouterr()
    status = main(["launch", "-n", "2", "--", "train", *args])
    return status, capsys.readouterr().out


def assert_launched_like(capsys, expected: list[float], out: Path, *args: str) -> None:
    """``jaxmoe launch -n 2 -- train ARGS --out OUT`` ends well, only process 0 reports and
    writes, and its losses are ``expected`` (one process's) within 1e-5 relative."""
    status, output = launch_here(capsys, *args, "--out", str(out))
    assert status == 0, output[-3000:]
    assert f"[host 0] done: {len(expected)} steps" in output
    assert "[host 1] done" not in output  # only process 0 reports and writes
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    launched = losses(out)
    assert len(launched) == len(expected)
    for a, b in zip(expected, launched, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (expected, launched)


# Two processes train like one under the default gradient sync in
# test_multiprocess_checkpoint.py's run (losses within 1e-5 up to the preemption), and with
# hierarchical sync below, which also checks what only process 0 reports and writes.
@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path, capsys):
    common = ["--steps", "5", *SMALL]
    single_losses = train_here(tmp_path / "one", *common)
    assert_launched_like(capsys, single_losses, tmp_path / "two", *common)


def test_hierarchical_takes_each_process_as_a_host(tmp_path, capsys):
    """Two processes of 4 devices, hosts from the processes: the same grouping, hence the
    same losses, as one process told that hosts hold 4 devices."""
    common = ["--steps", "3", *SMALL, "--parallel.data", "2", "--parallel.expert", "4"]
    common += ["--train.grad_sync", "hierarchical"]
    one = train_here(tmp_path / "one", *common, "--train.grad_sync_devices_per_host", "4")
    assert_launched_like(capsys, one, tmp_path / "two", *common)


def test_killing_one_process_stops_the_other_within_the_bound(tmp_path):
    port = free_port()
    common = ["train", "--steps", str(LONG), *SMALL, "--heartbeat-timeout", "10"]
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
            time.sleep(0.02)
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


def _children(parent: int) -> dict[int, list[str]]:
    """``pid -> argv`` of the live child processes of ``parent`` (Linux /proc)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode().rstrip("\0").split("\0")
        except OSError:
            continue
        # The parent pid is the 2nd field after the parenthesised command name.
        if int(stat.rpartition(")")[2].split()[1]) == parent:
            children[int(entry.name)] = argv
    return children


def test_launcher_stops_the_others_at_once_when_one_is_killed(tmp_path):
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        jaxmoe("launch", "-n", "2", "--", "train", "--steps", str(LONG), *SMALL, "--out", str(out)),
        env=child_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, "training did not start"
            assert launcher.poll() is None, "".join(lines)
            time.sleep(0.02)
        (victim,) = (
            pid
            for pid, argv in _children(launcher.pid).items()
            if argv[-2:] == ["--process-id", "1"]
        )
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(timeout=120)
        stopped_after = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    reader.join(timeout=10)
    output = "".join(lines)
    assert launcher.returncode == 1
    assert stopped_after < 15, stopped_after  # not the heartbeat (30 s) nor a step timeout
    # "; stopping the other process ..." follows unless the survivor aborted by itself.
    assert lines[-1].startswith("jaxmoe launch: process 1 was killed by SIGKILL")
    assert not any(sign in output for sign in PEER_FAILURE_SIGNS), output[-3000:]
    assert not _children(launcher.pid)


def _fake_processes(scripts: dict[int, str]):
    """A launch ``wrap`` that runs ``python -c scripts[i]`` as process i instead of training."""

    def wrap(index: int, argv: list[str]) -> list[str]:
        return [sys.executable, "-u", "-c", scripts[index]]

    return wrap


# Prints, then ignores SIGTERM and keeps printing: only SIGKILL ends it (or a minute).
STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("working", flush=True)
for _ in range(1200):
    time.sleep(0.05)
    print("after the failure", flush=True)
"""
FAILS = "import time, sys; time.sleep(1); print('my own last words', flush=True); sys.exit(7)"


def test_launcher_names_the_failed_process_and_ends_the_others_within_the_bound():
    output = io.StringIO()
    started = time.monotonic()
    status = launch(
        ["train"],
        3,
        wrap=_fake_processes({0: STUBBORN, 1: FAILS, 2: STUBBORN}),
        stop_timeout_s=1.0,
        output=output,
        resume_hint="resume with --resume",
    )
    elapsed = time.monotonic() - started
    assert status == 1
    lines = output.getvalue().splitlines()
    assert lines[-1] == failure_message(1, 7, 2, "resume with --resume")
    assert lines[-1] == (
        "jaxmoe launch: process 1 failed with exit status 7; stopping the other 2 processes "
        "(their further output is not shown); resume with --resume"
    )
    assert "[host 1] my own last words" in lines
    assert "[host 0] working" in lines and "[host 2] working" in lines
    # Nothing of the others after the failure line; SIGKILL after 1 s of ignored SIGTERM.
    assert elapsed < 1 + 1 + 5, elapsed


def test_a_survivors_abort_right_after_the_failure_is_not_shown():
    # As gloo does: process 0 sees its peer's connection close, dumps and aborts at once.
    port = free_port()
    survivor = f"""
import os, socket
server = socket.create_server(("127.0.0.1", {port}))
print("listening", flush=True)
peer, _ = server.accept()
peer.recv(1)
for line in range(200):
    print("stack frame", line, flush=True)
os.abort()
"""
    victim = f"""
import os, socket, time
for _ in range(200):
    try:
        peer = socket.create_connection(("127.0.0.1", {port}))
        break
    except ConnectionRefusedError:
        time.sleep(0.05)
time.sleep(0.5)
os._exit(9)
"""
    output = io.StringIO()
    status = launch(["train"], 2, wrap=_fake_processes({0: survivor, 1: victim}), output=output)
    assert status == 1
    assert "stack frame" not in output.getvalue()
    assert (
        output.getvalue()
        .splitlines()[-1]
        .startswith("jaxmoe launch: process 1 failed with exit status 9")
    )


def test_a_signal_is_passed_on_once_and_the_processes_may_finish():
    saves = """
import signal, sys, time
def save(signum, frame):
    print("saving after", signal.Signals(signum).name, flush=True)
    time.sleep(0.5)
    sys.exit(75)
signal.signal(signal.SIGTERM, save)
print("ready", flush=True)
time.sleep(60)
"""

    class SignalWhenReady(io.StringIO):
        def write(self, text: str) -> int:
            written = super().write(text)
            if self.getvalue().count("ready") == 2 and "sent" not in vars(self):
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)  # to the launcher: it passes it on
            return written

    output = SignalWhenReady()
    status = launch(["train"], 2, wrap=_fake_processes({0: saves, 1: saves}), output=output)
    assert status == 75
    lines = output.getvalue().splitlines()
    assert sorted(lines[-3:-1]) == [
        "[host 0] saving after SIGTERM",
        "[host 1] saving after SIGTERM",
    ]
    assert lines[-1] == "jaxmoe launch: the run stopped on a signal after writing a checkpoint"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_third_signal_kills_processes_that_ignore_the_first_two():
    def signal_thrice():
        for _ in range(3):  # spaced: a pending signal is not queued twice
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)

    class SignalThriceWhenWorking(io.StringIO):
        def write(self, text: str) -> int:
            written = super().write(text)
            if self.getvalue().count("working") == 2 and "sent" not in vars(self):
                self.sent = True
                threading.Thread(target=signal_thrice, daemon=True).start()
            return written

    output = SignalThriceWhenWorking()
    wrap = _fake_processes({0: STUBBORN, 1: STUBBORN})
    assert launch(["train"], 2, wrap=wrap, output=output) == 128 + signal.SIGKILL


@pytest.mark.parametrize(
    ("returncode", "description"),
    [
        (3, "failed with exit status 3"),
        (-9, "was killed by SIGKILL"),
        (-6, "was killed by SIGABRT"),
    ],
)
def test_exit_descriptions(returncode, description):
    assert failure_message(0, returncode, 0, None) == f"jaxmoe launch: process 0 {description}"
