"""A fault drill: each way a run can fail, done for real, and what the user gets.

    sudo .venv/bin/python -m experiments.faults [--steps 12]

Every fault runs the ``jaxmoe`` command in fresh processes on a small model (the
``tiny`` preset cut to 2 layers of width 64): signals and kills mid-run and
mid-checkpoint, a killed process of a two-process run, a resume into another
layout, damaged newest checkpoints and none readable, a signal while the run
imports JAX and while it starts, a diverging loss, a full disk and a disk that
another process fills mid-run (small tmpfs mounts; need root, skipped without it)
and bad inputs, an impossible shape among them. For each it
records what the user sees (the exit status and the message), the time from the
fault to the exit, the steps of work lost (done before the fault, not in the
checkpoint it resumes from), and whether the resumed run logs the same metrics as
the uninterrupted one. Writes ``experiments/results/faults.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "faults.md"
SMALL = ["--model.num_layers", "2", "--model.d_model", "64", "--data.max_bytes", "300000"]
SMALL += ["--no-progress", "--train.eval_every", "4"]
EXACT_KEYS = ("loss", "total_loss", "grad_norm", "learning_rate", "dropped_fraction", "val_loss")


@dataclass
class Outcome:
    fault: str
    seen: str  # exit status and the message
    stop_s: float | None = None  # fault -> exit
    lost_steps: int | None = None
    matched: str = "n/a"


def _env() -> dict[str, str]:
    from jaxmoe.cli.launch import child_environment

    return child_environment()


def _jaxmoe(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxmoe.cli", *args]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _strict_json(out: Path) -> bool:
    """Whether every metrics line parses as strict JSON (no NaN or Infinity)."""

    def refuse(name: str) -> None:
        raise ValueError(name)

    try:
        for line in (out / "metrics.jsonl").read_text().splitlines():
            json.loads(line, parse_constant=refuse)
    except ValueError:
        return False
    return True


def _last_message(text: str) -> str:
    """The user's last line from jaxmoe (its own messages all start with 'jaxmoe')."""
    lines = [line for line in text.splitlines() if "jaxmoe" in line and "Warning" not in line]
    return lines[-1].strip() if lines else "no message"


def _seen(returncode: int, output: str) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}: no message (nothing runs after it)"
    return f"status {returncode}: {_last_message(output)}"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        _jaxmoe(*args), env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _checkpoint_step(out: Path) -> int | None:
    from jaxmoe.train.checkpoint import latest_checkpoint

    return latest_checkpoint(out)


def _compare(rows: list[dict], reference: list[dict], tolerance: float = 0.0) -> str:
    if [row["step"] for row in rows] != [row["step"] for row in reference]:
        return f"no (steps {[row['step'] for row in rows]})"
    worst = 0.0
    for row, expected in zip(rows, reference, strict=True):
        for key in EXACT_KEYS:
            a, b = row.get(key), expected.get(key)
            if a == b:
                continue
            if a is None or b is None:
                return f"no ({key} at step {row['step']})"
            worst = max(worst, abs(a - b) / max(abs(b), 1e-30))
    if worst == 0.0:
        return "yes, bit for bit"
    if worst <= tolerance:
        return f"yes, within {worst:.1e} relative"
    return f"no (max relative difference {worst:.1e})"


def _interrupt(
    out: Path,
    argv: list[str],
    when: Callable[[Path], bool],
    fault: Callable[[subprocess.Popen], None],
    launcher: bool = False,
) -> tuple[subprocess.Popen, str, float, int]:
    """Start a run, wait for ``when(out)``, inject ``fault``; returns the process, its
    output, seconds from the fault to the exit, and the steps done at the fault."""
    command = ["launch", "-n", "2", "--", "train"] if launcher else ["train"]
    process = subprocess.Popen(
        _jaxmoe(*command, *argv, "--out", str(out)),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not when(out):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"the run ended before the fault: {process.communicate()[0][-2000:]}"
            )
        time.sleep(0.005)
    done_at_fault = len(_rows(out))
    injected = time.monotonic()
    fault(process)
    output, _ = process.communicate(timeout=300)
    return process, output, time.monotonic() - injected, done_at_fault


def _rows_at_least(count: int) -> Callable[[Path], bool]:
    return lambda out: len(_rows(out)) >= count


def _writing_after(step: int) -> Callable[[Path], bool]:
    """The checkpoint of ``step`` complete (Orbax renames its directory to the step when
    it is) and the next one's being written."""

    def writing(out: Path) -> bool:
        checkpoints = out / "checkpoints"
        names = [p.name for p in checkpoints.iterdir()] if checkpoints.exists() else []
        return str(step) in names and any("tmp" in name for name in names)

    return writing


def _saving(out: Path) -> bool:
    checkpoints = out / "checkpoints"
    names = [p.name for p in checkpoints.iterdir()] if checkpoints.exists() else []
    return any("tmp" in name for name in names) and len(names) >= 3


def _pkill(pattern: str, number: int) -> Callable[[subprocess.Popen], None]:
    def fault(process: subprocess.Popen) -> None:
        subprocess.run(["pkill", f"-{number}", "-f", pattern], check=False)

    return fault


def _resume_and_compare(
    name: str,
    out: Path,
    process: subprocess.Popen,
    output: str,
    stop_s: float,
    done: int,
    common: list[str],
    reference: list[dict],
    *,
    resume_args: tuple[str, ...] = (),
    tolerance: float = 0.0,
    launcher: bool = False,
) -> Outcome:
    saved = _checkpoint_step(out) or 0
    command = ["launch", "-n", "2", "--", "train"] if launcher else ["train"]
    resumed = _run(*command, *common, "--out", str(out), "--resume", *resume_args)
    matched = (
        _compare(_rows(out), reference, tolerance)
        if resumed.returncode == 0
        else f"resume failed: {_last_message(resumed.stderr + resumed.stdout)}"
    )
    return Outcome(
        name,
        _seen(process.returncode, output),
        stop_s,
        max(0, done - saved),
        matched,
    )


def drill(steps: int, scratch: Path) -> list[Outcome]:
    common = ["--steps", str(steps), *SMALL, "--train.checkpoint_every", "2"]
    reference_dir = scratch / "reference"
    reference_run = _run("train", *common, "--out", str(reference_dir))
    assert reference_run.returncode == 0, reference_run.stderr[-2000:]
    reference = _rows(reference_dir)
    outcomes = []

    out = scratch / "sigterm"
    result = _interrupt(out, common, _rows_at_least(3), lambda p: p.send_signal(signal.SIGTERM))
    outcomes.append(
        _resume_and_compare("SIGTERM mid-run, then --resume", out, *result, common, reference)
    )

    out = scratch / "sigkill"
    result = _interrupt(out, common, _rows_at_least(5), lambda p: p.kill())
    outcomes.append(
        _resume_and_compare("SIGKILL mid-run, then --resume", out, *result, common, reference)
    )

    out = scratch / "kill-saving"
    every_step = [*common, "--train.checkpoint_every", "1"]
    result = _interrupt(out, every_step, _saving, lambda p: p.kill())
    outcomes.append(
        _resume_and_compare(
            "SIGKILL during a checkpoint write, then --resume", out, *result, common, reference
        )
    )

    out = scratch / "peer"
    result = _interrupt(
        out, common, _rows_at_least(3), _pkill(f"out {out} .*--process-id 1", 9), launcher=True
    )
    outcomes.append(
        _resume_and_compare(
            "kill process 1 of a 2-process run, then --resume (2 processes)",
            out,
            *result,
            common,
            reference,
            tolerance=1e-5,
            launcher=True,
        )
    )

    out = scratch / "layout"
    result = _interrupt(out, common, _rows_at_least(3), lambda p: p.send_signal(signal.SIGTERM))
    outcomes.append(
        _resume_and_compare(
            "SIGTERM, then --resume with parallel.data 2 x parallel.expert 4",
            out,
            *result,
            common,
            reference,
            resume_args=("--parallel.data", "2", "--parallel.expert", "4"),
            tolerance=1e-5,
        )
    )

    outcomes.extend(_finished_resumes(reference_dir, common))
    outcomes.extend(_corrupt_checkpoints(scratch, common, reference))
    outcomes.extend(_import_signals(scratch, common))
    outcomes.extend(_early_signals(scratch, common))

    out = scratch / "nan"
    started = time.monotonic()
    nan = _run("train", *common, "--out", str(out), "--train.learning_rate", "1e6")
    rows = _rows(out)
    outcomes.append(
        Outcome(
            "non-finite loss (learning rate 1e6)",
            _seen(nan.returncode, nan.stderr),
            None,
            rows[-1]["step"] - (_checkpoint_step(out) or 0) if rows else None,
            f"n/a (metrics strict JSON: {_strict_json(out)}; "
            f"ran {time.monotonic() - started:.0f} s)",
        )
    )
    outcomes.append(_full_disk(scratch, common))
    outcomes.append(_disk_filled_mid_run(scratch, common))
    outcomes.extend(_bad_inputs(scratch))
    return outcomes


def _finished_resumes(out: Path, common: list[str]) -> list[Outcome]:
    """``--resume`` of the finished reference run: as it is (nothing to train), and with a
    shared expert more and a step more (arrays of other shapes)."""
    outcomes = []
    for name, extra in (
        ("--resume of the finished run", []),
        (
            "--resume with a step more and moe.num_shared_experts 1",
            ["--steps", str(int(common[1]) + 1), "--moe.num_shared_experts", "1"],
        ),
    ):
        started = time.monotonic()
        resumed = _run("train", *common, *extra, "--out", str(out), "--resume")
        lines = (resumed.stdout + resumed.stderr).strip().splitlines()
        outcomes.append(
            Outcome(
                name,
                f"status {resumed.returncode}: {lines[-1] if lines else 'no message'}",
                time.monotonic() - started,
                None,
                f"n/a (lines of output: {len(lines)})",
            )
        )
    return outcomes


def _truncate_largest_data_file(checkpoint: Path) -> None:
    largest = max(
        (p for p in (checkpoint / "state").rglob("*") if p.is_file()), key=os.path.getsize
    )
    with largest.open("r+b") as data:
        data.truncate(largest.stat().st_size // 2)


def _resume_past(name: str, out: Path, common: list[str], reference: list[dict]) -> Outcome:
    """``--resume`` of the run in ``out`` (whose newest checkpoints were damaged): what the
    user sees, and whether the run then logs the same metrics as the reference."""
    started = time.monotonic()
    resumed = _run("train", *common, "--out", str(out), "--resume")
    seconds = time.monotonic() - started
    skipped = [line for line in resumed.stdout.splitlines() if "cannot be read" in line]
    resuming = [line for line in resumed.stdout.splitlines() if "resuming from" in line]
    seen = f"status {resumed.returncode}: " + " / ".join([*skipped, *resuming][:3])
    matched = (
        _compare(_rows(out), reference)
        if resumed.returncode == 0
        else f"resume failed: {_last_message(resumed.stderr + resumed.stdout)}"
    )
    return Outcome(name, seen, seconds, None, matched)


def _corrupt_checkpoints(scratch: Path, common: list[str], reference: list[dict]) -> list[Outcome]:
    """A run stopped half way, in three copies: its newest checkpoint truncated; that one
    truncated and the one before without its metadata (``--resume`` passes over them to the
    newest intact one); none with its metadata (``--resume`` refuses)."""
    half_way = scratch / "half-way"
    half = [*common[:1], str(int(common[1]) // 2), *common[2:]]
    first = _run("train", *half, "--out", str(half_way))
    assert first.returncode == 0, first.stderr[-2000:]
    newest = _checkpoint_step(half_way)
    outcomes = []

    out = shutil.copytree(half_way, scratch / "corrupt-newest")
    _truncate_largest_data_file(out / "checkpoints" / str(newest))
    outcome = _resume_past(
        f"--resume with the newest checkpoint (step {newest}) half truncated",
        out,
        common,
        reference,
    )
    outcomes.append(outcome)

    out = shutil.copytree(half_way, scratch / "corrupt-two")
    _truncate_largest_data_file(out / "checkpoints" / str(newest))
    (out / "checkpoints" / str(newest - 2) / "state" / "_METADATA").unlink()
    outcome = _resume_past(
        f"--resume with checkpoint {newest} truncated and {newest - 2} without its metadata",
        out,
        common,
        reference,
    )
    outcomes.append(outcome)

    out = shutil.copytree(half_way, scratch / "corrupt-all")
    checkpoints = out / "checkpoints"
    for entry in checkpoints.iterdir():
        if entry.name.isdigit():
            (entry / "state" / "_METADATA").unlink()
    before = sorted(p.name for p in checkpoints.iterdir())
    started = time.monotonic()
    none = _run("train", *common, "--out", str(out), "--resume")
    after = sorted(p.name for p in checkpoints.iterdir())
    outcomes.append(
        Outcome(
            "--resume with no readable checkpoint",
            _seen(none.returncode, none.stderr),
            time.monotonic() - started,
            None,
            f"n/a (checkpoints untouched: {before == after})",
        )
    )
    return outcomes


def _import_signals(scratch: Path, common: list[str]) -> list[Outcome]:
    """SIGINT and SIGTERM while the command imports JAX (once jaxlib's extension modules
    are mapped into the process): it ends at once with status 75 and one line."""
    outcomes = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        out = scratch / f"import-{signum.name}"
        started = time.monotonic()
        process = subprocess.Popen(
            _jaxmoe("train", *common, "--out", str(out)),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        maps = Path(f"/proc/{process.pid}/maps")
        while "/jaxlib/" not in maps.read_text():
            if process.poll() is not None or time.monotonic() > started + 60:
                raise RuntimeError(f"JAX was never imported: {process.communicate()[0][-2000:]}")
            time.sleep(0.001)
        injected = time.monotonic()
        process.send_signal(signum)
        output, _ = process.communicate(timeout=120)
        outcomes.append(
            Outcome(
                f"{signum.name} while importing JAX ({injected - started:.2f} s after the start)",
                _seen(process.returncode, output),
                time.monotonic() - injected,
                None,
                f"n/a (lines of output: {len(output.splitlines())}; tracebacks: "
                f"{output.count('Traceback')}; run files left: {_run_files(out)})",
            )
        )
    return outcomes


def _run_files(out: Path) -> int:
    from jaxmoe.cli.run_dir import RUN_FILES

    return sum((out / name).exists() for name in RUN_FILES)


def _early_signals(scratch: Path, common: list[str]) -> list[Outcome]:
    """SIGINT and SIGTERM while the run starts (the state being built, the step
    compiling): it ends at once with status 75 and leaves no checkpoint."""
    outcomes = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        out = scratch / f"early-{signum.name}"
        process, output, stop_s, _ = _interrupt(
            out,
            common,
            lambda out: (out / "checkpoints").exists(),
            lambda p, signum=signum: p.send_signal(signum),
        )
        rows = _rows(out)
        outcomes.append(
            Outcome(
                f"{signum.name} while starting (compiling)",
                _seen(process.returncode, output),
                stop_s,
                None,
                f"n/a (checkpoint left: {_checkpoint_step(out)}; metrics lines: {len(rows)})",
            )
        )
    return outcomes


def _full_disk(scratch: Path, common: list[str]) -> Outcome:
    name = "full disk (a 24 MB tmpfs)"
    if os.geteuid() != 0:
        return Outcome(name, "skipped: mounting a tmpfs needs root")
    mount = scratch / "tmpfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    try:
        out = mount / "run"
        started = time.monotonic()
        full = _run(
            "train",
            *common,
            "--out",
            str(out),
            "--train.checkpoint_every",
            "1",
            "--train.keep_checkpoints",
            "50",
        )
        stop_s = time.monotonic() - started
        rows = _rows(out)
        saved = _checkpoint_step(out) or 0
        return Outcome(
            name,
            _seen(full.returncode, full.stderr),
            None,
            len(rows) - saved,
            f"n/a (metrics strict JSON: {_strict_json(out)}, {len(rows)} lines; "
            f"ran {stop_s:.0f} s)",
        )
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _disk_filled_mid_run(scratch: Path, common: list[str]) -> Outcome:
    """The disk filled by another process while the run writes its second checkpoint (of
    step 4), the first one complete."""
    name = "disk filled by another process during the write of checkpoint 4 (a 64 MB tmpfs)"
    if os.geteuid() != 0:
        return Outcome(name, "skipped: mounting a tmpfs needs root")
    mount = scratch / "tmpfs-mid-run"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], check=True)

    def fill(process: subprocess.Popen) -> None:
        with (mount / "filler").open("wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(bytes(1 << 20))
            except OSError:
                pass

    try:
        out = mount / "run"
        argv = [*common, "--train.keep_checkpoints", "50"]
        process, output, stop_s, done = _interrupt(out, argv, _writing_after(2), fill)
        saved = _checkpoint_step(out)
        return Outcome(
            name,
            _seen(process.returncode, output),
            stop_s,
            None if saved is None else max(0, done - saved),
            f"n/a (last checkpoint kept: {saved}; lines of output: {len(output.splitlines())}; "
            f"tracebacks: {output.count('Traceback')}; metrics strict JSON: {_strict_json(out)})",
        )
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _bad_inputs(scratch: Path) -> list[Outcome]:
    afile = scratch / "afile"
    afile.write_text("x")
    curves = {
        "missing": scratch / "no-such.json",
        "invalid": scratch / "invalid.json",
        "empty": scratch / "empty.json",
    }
    curves["invalid"].write_text("{not json")
    curves["empty"].write_text('{"curves": []}')
    data_dir = scratch / "data-dir"
    data_dir.mkdir()
    held = scratch / "held"
    (held / "checkpoints" / "3").mkdir(parents=True)
    (held / "config.json").write_text("{}")
    ragged = ["--moe.capacity_factor", "none", "--moe.dropless_dispatch", "ragged"]
    cases = [
        ("--out /proc/x", ["train", "--out", "/proc/x"]),
        ("--out under a file", ["train", "--out", str(afile / "sub")]),
        ("--out holding a run", ["train", "--out", str(held)]),
        *(
            (
                f"link curves: {kind} file",
                ["train", "--schedule", "dw", "--schedule.link_curves", str(path)],
            )
            for kind, path in curves.items()
        ),
        ("--step-timeout -1", ["train", "--step-timeout", "-1"]),
        ("--data a directory", ["train", "--data", str(data_dir)]),
        ("--steps 3 --train.steps 5", ["train", "--steps", "3", "--train.steps", "5"]),
        ("launch -n 3 on 8 devices", ["launch", "-n", "3", "--", "train"]),
        ("--model.d_model 1000000000", ["train", "--model.d_model", "1000000000"]),
        (
            "ragged dispatch with parallel.expert_tensor 2",
            ["train", *ragged, "--parallel.expert", "4", "--parallel.expert_tensor", "2"],
        ),
    ]
    outcomes = []
    for name, argv in cases:
        started = time.monotonic()
        # The case's own flags after SMALL's, so that they win.
        flags = [] if argv[0] == "launch" else SMALL
        result = _run(argv[0], *flags, *argv[1:], timeout=120)
        seconds = time.monotonic() - started
        lines = result.stderr.strip().splitlines()
        outcomes.append(
            Outcome(
                f"bad input: {name}",
                f"status {result.returncode}: {lines[-1] if lines else result.stdout.strip()}"
                + ("" if len(lines) == 1 else f" ({len(lines)} lines)"),
                seconds,
            )
        )
    return outcomes


def _table(outcomes: list[Outcome]) -> list[str]:
    lines = [
        "| fault | what the user sees | time to stop (s) | steps lost | resumed run matches |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        stop = "" if o.stop_s is None else f"{o.stop_s:.1f}"
        lost = "" if o.lost_steps is None else str(o.lost_steps)
        seen = o.seen.replace("|", "\\|")
        lines.append(f"| {o.fault} | {seen} | {stop} | {lost} | {o.matched} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        outcomes = drill(args.steps, Path(scratch))
    for outcome in outcomes:  # the results name no directory of the machine they ran on
        outcome.seen = outcome.seen.replace(scratch, "<scratch>")
    lines = [
        "# Fault drill",
        "",
        f"Command: `sudo .venv/bin/python -m experiments.faults --steps {args.steps}`",
        "",
        f"Each run: the `tiny` preset cut to 2 layers of width 64, {args.steps} steps, a "
        "checkpoint every 2 steps, on 8 fake CPU devices (two processes of 4 for the "
        "2-process faults). 'Time to stop' runs from the fault to the exit of the process "
        "(or the launcher); for bad inputs, the whole command. 'Steps lost' are the steps "
        "done before the fault that the checkpoint it resumes from does not hold. "
        "'Resumed run matches' compares every step's loss, total loss, gradient norm, "
        "learning rate, dropped fraction and validation loss with an uninterrupted run of the "
        "same configuration on 1 x 8 devices in one process (another layout or process count "
        "sums in another order, hence a tolerance there).",
        "",
        *_table(outcomes),
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
