"""How a run ends: signals, a kill mid-save, a non-finite loss, a full disk, its directory."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import chex
import jax
import numpy as np
import pytest

from jaxmoe import prepare
from jaxmoe.cli.launch import child_environment
from jaxmoe.cli.main import main
from jaxmoe.cli.run_dir import prepare_run_dir
from jaxmoe.config import ConfigError
from jaxmoe.exit_codes import IO_ERROR as IO_ERROR_EXIT_CODE
from jaxmoe.exit_codes import NONFINITE as NONFINITE_EXIT_CODE
from jaxmoe.exit_codes import PREEMPTED as PREEMPTED_EXIT_CODE
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.checkpoint import checkpoint_steps, latest_checkpoint
from jaxmoe.train.logs import metrics as metrics_module
from jaxmoe.train.logs.metrics import RunLog, read_rows
from jaxmoe.train.resolved import resolve
from jaxmoe.train.state import init_train_state
from jaxmoe.train.step import build_train_step

from .batches import random_batch
from .runs import EXACT_KEYS, ONE_LAYER, one_layer_config, small_config

# The one-layer model of tests/train/runs.py (width 32, 8 sequences of 16 tokens a step):
# what is under test is how a run ends, not the model.
SMALL = [*ONE_LAYER, "--no-progress", "--train.eval_every", "3"]
# The most steps whose step compiles as the 8-step run's: the tiny preset warms up over 20
# steps and decays over max(steps - 1, warmup + 1) = 21 for any run up to 22 steps, so such
# runs read the step back from the persistent compilation cache.
LONG = 22


def jaxmoe(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxmoe.cli", *args]


def strict_rows(run_dir: Path) -> list[dict]:
    """The metrics rows, refusing anything that is not strict JSON (NaN, Infinity)."""

    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]


def exact(rows: list[dict]) -> list[dict]:
    return [{key: row.get(key) for key in EXACT_KEYS} for row in rows]


def start_run(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        jaxmoe("train", *SMALL, "--out", str(out), *args),
        env=child_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_rows(process: subprocess.Popen, out: Path, count: int) -> None:
    deadline = time.monotonic() + 180
    while len(read_rows(out / "metrics.jsonl")) < count:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.02)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        jaxmoe("train", *SMALL, *args),
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def resume_here(capsys, out: Path, steps: int) -> str:
    """``jaxmoe train --resume`` of the run in ``out``, in this process; what it printed."""
    capsys.readouterr()
    assert main(["train", *SMALL, "--steps", str(steps), "--out", str(out), "--resume"]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """The directory of eight steps of the small run, never interrupted (not to be changed)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert main(["train", *SMALL, "--steps", "8", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def uninterrupted(finished_run) -> list[dict]:
    """The metrics of :func:`finished_run`."""
    return strict_rows(finished_run)


def test_resuming_a_finished_run_builds_nothing(finished_run, capsys, monkeypatch):
    def start_process(*args, **kwargs):
        raise AssertionError("the run was prepared")

    monkeypatch.setattr(prepare, "start_process", start_process)
    capsys.readouterr()
    assert main(["train", *SMALL, "--steps", "8", "--out", str(finished_run), "--resume"]) == 0
    assert capsys.readouterr().out == "done: the run already has its 8 steps\n"


def test_resuming_into_a_model_of_another_shape_is_one_line(finished_run, capsys):
    argv = ["train", *SMALL, "--steps", "9", "--out", str(finished_run), "--resume"]
    capsys.readouterr()
    assert main([*argv, "--moe.num_shared_experts", "1"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert "the checkpoint of step 8 holds a model of another shape (moe.num_shared_exper" in error
    assert not list((finished_run / "checkpoints").glob("*.unreadable"))  # none set aside


def test_sigterm_saves_exits_75_and_the_resumed_run_is_the_same(tmp_path, capsys, uninterrupted):
    out = tmp_path / "run"
    process = start_run(out, "--steps", "8")
    wait_for_rows(process, out, 2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr
    saved = latest_checkpoint(out)
    assert saved is not None and 2 <= saved < 8
    assert f"stopped by a signal after {saved} steps" in stderr and "--resume" in stderr

    assert f"resuming from the checkpoint of step {saved}" in resume_here(capsys, out, 8)
    chex.assert_trees_all_equal(exact(strict_rows(out)), exact(uninterrupted))


def test_a_second_signal_exits_at_once(tmp_path):
    out = tmp_path / "run"
    process = start_run(out, "--steps", str(LONG))
    wait_for_rows(process, out, 1)
    process.send_signal(signal.SIGINT)
    # Python runs a handler between bytecodes: two signals sent back to back while the
    # step runs in XLA would reach it as one. Send the second once the first is handled.
    for line in process.stderr:
        if "finishing this step" in line:
            break
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGINT


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_ones_whole(
    tmp_path, capsys, uninterrupted
):
    out = tmp_path / "run"
    process = start_run(out, "--steps", "8", "--train.checkpoint_every", "1")
    deadline = time.monotonic() + 180
    checkpoints = out / "checkpoints"
    while True:  # kill it while a checkpoint is half written, after two complete ones
        assert time.monotonic() < deadline, "no checkpoint write to interrupt"
        assert process.poll() is None, "the run ended before a checkpoint write was caught"
        names = [p.name for p in checkpoints.iterdir()] if checkpoints.exists() else []
        if any("tmp" in name for name in names) and len(names) >= 3:
            process.kill()
            break
        time.sleep(0.005)
    process.communicate()
    complete = latest_checkpoint(out)
    assert complete is not None and complete >= 2

    assert f"resuming from the checkpoint of step {complete}" in resume_here(capsys, out, 8)
    assert not any("tmp" in p.name for p in checkpoints.iterdir())
    chex.assert_trees_all_equal(exact(strict_rows(out)), exact(uninterrupted))


def test_a_nonfinite_loss_stops_with_status_4_and_strict_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    # Two layers of width 64, whose loss overflows to nan (the one layer's loss stays finite
    # while its gradient norm overflows); a step of its own anyway, at this learning rate.
    wider = ["--model.num_layers", "2", "--model.d_model", "64", "--data.max_bytes", "300000"]
    wider += ["--no-progress", "--train.eval_every", "3"]
    argv = ["train", *wider, "--steps", "6", "--out", str(out), "--train.checkpoint_every", "1"]
    argv += ["--train.learning_rate", "1e6", "--train.warmup_steps", "0"]
    assert main(argv) == NONFINITE_EXIT_CODE
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    rows = strict_rows(out)
    last = rows[-1]
    assert last["loss"] is None and f"step {last['step']}: the loss is nan" in error
    # The checkpoints hold finite states only: the last one is before the bad step.
    assert latest_checkpoint(out) == last["step"]
    assert f"the last checkpoint is step {last['step']}" in error


def test_skip_drops_nonfinite_updates_and_counts_them(tmp_path):
    # The one-layer model: after a first step at this rate its gradient norm overflows.
    config = one_layer_config(learning_rate=1e6, warmup_steps=0, on_nonfinite="skip")
    mesh = build_mesh(config.parallel)
    step = build_train_step(resolve(config, mesh)).jit()
    rng = np.random.default_rng(0)
    state, first = step(init_train_state(resolve(config, mesh)), random_batch(rng, config, mesh))
    assert first["skipped"] == 0  # a finite step, with a huge update
    before = jax.device_get((state.params, state.opt_state))
    state, second = step(state, random_batch(rng, config, mesh))
    assert not np.isfinite(second["grad_norm"]) and second["skipped"] == 1
    chex.assert_trees_all_equal(jax.device_get((state.params, state.opt_state)), before)
    assert int(state.step) == 2


def test_a_failed_metrics_write_leaves_only_whole_lines(tmp_path, monkeypatch):
    log = RunLog(tmp_path, small_config())
    log.write({"step": 0, "loss": 1.5})
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, data[:7])  # part of the line reaches the disk, then it is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics_module.os, "write", full_disk)
    with pytest.raises(OSError):
        log.write({"step": 1, "loss": float("nan")})
    monkeypatch.undo()
    log.write({"step": 1, "loss": float("inf")})
    log.close()
    assert strict_rows(tmp_path) == [{"step": 0, "loss": 1.5}, {"step": 1, "loss": None}]


@pytest.mark.parametrize(
    ("setup", "flags", "message"),
    [
        ("file", [], "is a file, not a directory"),
        ("file-parent", [], "cannot write there"),
        ("run", [], "already holds a run (config.json, metrics.jsonl, checkpoints): add"),
        ("none", ["--resume", "--overwrite"], "not allowed with argument"),
        ("proc", [], "cannot write there"),
    ],
)
def test_a_bad_out_directory_is_one_line_before_compiling(tmp_path, capsys, setup, flags, message):
    out = tmp_path / "out"
    if setup == "file":
        out.write_text("x")
    elif setup == "file-parent":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "sub"
    elif setup == "run":
        (out / "checkpoints" / "3").mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "metrics.jsonl").write_text("")
    elif setup == "proc":
        out = Path("/proc/jaxmoe-test")
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["train", *SMALL, "--out", str(out), *flags]))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert time.monotonic() - started < 5  # refused before any compilation


def test_overwrite_deletes_the_run_files_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints" / "3").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "notes.txt").write_text("mine")
    assert main(["train", *SMALL, "--steps", "1", "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert [row["step"] for row in strict_rows(out)] == [0]
    assert latest_checkpoint(out) == 1


def test_what_a_run_wrote_before_its_first_checkpoint_is_replaced(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoints" / "1.orbax-checkpoint-tmp").mkdir(parents=True)  # half written
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "notes.txt").write_text("mine")
    prepare_run_dir(out, resume=False, overwrite=False)
    assert [path.name for path in out.iterdir()] == ["notes.txt"]
    assert "replacing the files of a run that wrote no checkpoint (metrics.jsonl, checkpo" in (
        capsys.readouterr().out
    )
    # A checkpoint set aside as unreadable is still the run's: refused, not replaced.
    (out / "checkpoints" / "2.unreadable").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare_run_dir(out, resume=False, overwrite=False)


def test_too_little_free_space_is_refused(tmp_path, monkeypatch):
    from jaxmoe.cli import run_dir

    usage = SimpleNamespace(total=10**9, used=10**9 - 10**6, free=10**6)
    monkeypatch.setattr(run_dir.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(ConfigError, match=r"1\.0 MB free, but a checkpoint .* about 32\.1 MB"):
        run_dir.check_free_space(tmp_path, 32_100_000)
    run_dir.check_free_space(tmp_path, 999_999)


@pytest.fixture
def tmpfs(tmp_path):
    """Mounts a tmpfs of the given size (root only); each is unmounted after the test."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def mount(size: str) -> Path:
        point = tmp_path / f"disk{len(mounted)}"
        point.mkdir()
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)])
        if made.returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


# A checkpoint of the small model takes 0.6 to 0.75 MB on disk, and is checked for with
# headroom (0.9 MB): a disk of 1.4 MB has room for one checkpoint and not two, one of
# 2.2 MB for two.
ONE_CHECKPOINT, TWO_CHECKPOINTS = "1400k", "2200k"


def test_a_full_disk_stops_the_run_in_one_line_and_keeps_its_checkpoints(tmpfs):
    out = tmpfs(ONE_CHECKPOINT) / "run"
    result = run_cli(
        "--steps", "12", "--out", str(out), "--train.checkpoint_every", "1",
        "--train.keep_checkpoints", "50",
    )  # fmt: skip
    assert result.returncode == IO_ERROR_EXIT_CODE, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if "Traceback" in line] == []
    assert "no space left for the checkpoint of step" in result.stderr.splitlines()[-1]
    saved = latest_checkpoint(out)
    assert saved is not None and f"the last checkpoint is step {saved}" in result.stderr
    strict_rows(out)  # every line whole


# `jaxmoe train ARGS` with the disk filled, as another process would fill it, between the
# room check of the checkpoint of step 2 and its write: the write fails part of the way.
FILLED_DURING_A_SAVE = """
import sys
from jaxmoe.cli.main import main
from jaxmoe.cli.run_dir import prepare_run_dir
from jaxmoe.train.checkpoint import RunCheckpoints

save = RunCheckpoints._save

def fill_then_save(self, step, state, run):
    if step == 2:
        with open(self.directory.parent / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(bytes(1 << 16))
            except OSError:
                pass
    save(self, step, state, run)

RunCheckpoints._save = fill_then_save
sys.exit(main(sys.argv[1:]))
"""


def test_a_disk_filling_during_a_checkpoint_write_is_one_line(tmpfs):
    out = tmpfs(TWO_CHECKPOINTS) / "run"
    argv = ["train", *SMALL, "--steps", "4", "--out", str(out)]
    argv += ["--train.checkpoint_every", "1", "--train.keep_checkpoints", "50"]
    result = subprocess.run(
        [sys.executable, "-c", FILLED_DURING_A_SAVE, *argv],
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == IO_ERROR_EXIT_CODE, result.stderr[-2000:]
    # Not Orbax's and TensorStore's reports of the same failure besides, one per array.
    assert len(result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert "no space left on device" in result.stderr
    assert "the last checkpoint is step 1" in result.stderr
    assert latest_checkpoint(out) == 1


def _truncate_largest_data_file(checkpoint: Path) -> None:
    largest = max(
        (p for p in (checkpoint / "state").rglob("*") if p.is_file()), key=os.path.getsize
    )
    with largest.open("r+b") as data:
        data.truncate(largest.stat().st_size // 2)


def test_resume_passes_over_unreadable_checkpoints_and_deletes_nothing(
    tmp_path, capsys, uninterrupted
):
    out = tmp_path / "run"
    every = ["--train.checkpoint_every", "1", "--out", str(out)]
    assert main(["train", *SMALL, "--steps", "3", *every]) == 0
    checkpoints = out / "checkpoints"
    _truncate_largest_data_file(checkpoints / "3")
    (checkpoints / "2" / "state" / "_METADATA").unlink()
    capsys.readouterr()

    assert main(["train", *SMALL, "--steps", "4", *every, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "the checkpoint of step 3 cannot be read (OUT_OF_RANGE" in printed
    assert "the checkpoint of step 2 cannot be read (its tree metadata (_METADATA) is" in printed
    assert "resuming from the checkpoint of step 1" in printed
    # Set aside, not deleted; the run wrote steps 2 to 4 again.
    assert {"2.unreadable", "3.unreadable"} <= {p.name for p in checkpoints.iterdir()}
    assert latest_checkpoint(out) == 4
    rows = {row["step"]: row for row in strict_rows(out)}
    assert exact([rows[step] for step in range(3)]) == exact(uninterrupted[:3])

    # None readable: one line, status 2, nothing deleted or set aside.
    for step in checkpoint_steps(out):
        (checkpoints / str(step) / "state" / "_METADATA").unlink()
    before = sorted(p.name for p in checkpoints.iterdir())
    assert main(["train", *SMALL, "--steps", "5", *every, "--resume"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "no checkpoint in" in error[0] and "can be read" in error[0]
    assert sorted(p.name for p in checkpoints.iterdir()) == before


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_while_jax_is_imported_ends_the_run_in_one_line(tmp_path, signum):
    process = start_run(tmp_path / "run", "--steps", "5")
    maps = Path(f"/proc/{process.pid}/maps")
    deadline = time.monotonic() + 60
    while "/jaxlib/" not in maps.read_text():  # JAX's extension modules are being loaded
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "JAX was never imported"
        time.sleep(0.001)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr
    assert stderr == (
        f"jaxmoe: {signum.name} while starting: stopped before the first step, no checkpoint "
        "written\n"
    )


def test_a_signal_while_starting_ends_the_run_at_once_without_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    process = start_run(out, "--steps", "5000")
    # The checkpoint directory is made just before the state is built and the steps
    # compiled: seconds of start-up still to go.
    deadline = time.monotonic() + 120
    while not (out / "checkpoints").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, stderr = process.communicate(timeout=30)
    assert time.monotonic() - sent < 5
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr
    assert "SIGINT while starting: stopped before the first step" in stderr
    assert "Traceback" not in stderr
    assert latest_checkpoint(out) is None
    assert read_rows(out / "metrics.jsonl") == []
    # Nothing it leaves refuses the next run into the directory.
    prepare_run_dir(out, resume=False, overwrite=False)
    assert not (out / "checkpoints").exists()
