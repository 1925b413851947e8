"""The run directory (``--out``): checked before anything compiles, started, resumed or cleared.

A run directory holds :data:`RUN_FILES`: the configuration, the metrics (also for
TensorBoard, with the profiler's traces), the schedule report and timeline, the
checkpoints. Starting a run in a directory that holds another (a checkpoint of it) is
refused unless the user says what to do with it: ``--resume`` continues it from its
latest complete checkpoint, ``--overwrite`` deletes those files (and only those) first.
What a run wrote before its first checkpoint (one that failed or was stopped while it
started) holds nothing to continue: the next run replaces it, saying so. Every check here
runs before the first compilation, so a bad ``--out`` costs a second, not a compilation.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jaxmoe.config import Config, ConfigError
from jaxmoe.train.checkpoint import (
    CHECKPOINT_DIR,
    check_compatible,
    checkpoint_steps,
    holds_checkpoints,
    saved_config,
)
from jaxmoe.train.logs.metrics import METRICS_FILE
from jaxmoe.train.logs.tensorboard import TENSORBOARD_DIR

# What a run writes under --out (and what --overwrite removes).
RUN_FILES = (
    "config.json",
    METRICS_FILE,
    "schedule_report.json",
    "schedule_timeline.json",
    "schedule_timeline.png",
    "grad_sync_choice.json",
    "placement.jsonl",
    TENSORBOARD_DIR,
    CHECKPOINT_DIR,
)


@dataclass(frozen=True)
class RunStart:
    """How a run begins in its directory."""

    resume_step: int | None  # the checkpoint to continue from; None: a new run
    changed_fields: tuple[str, ...] = ()  # config fields that differ from the checkpoint's


def _existing_run_files(out: Path) -> list[str]:
    return [name for name in RUN_FILES if (out / name).exists()]


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file, not a directory: choose a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise ConfigError(
            f"--out {out}: cannot write there ({error.strerror or error}): "
            "choose a directory you can write"
        ) from None


def check_free_space(out: str | os.PathLike, checkpoint_bytes: int) -> None:
    """Refuse a directory without room for one checkpoint of ``checkpoint_bytes``."""
    out = Path(out)
    free = shutil.disk_usage(out).free
    if free < checkpoint_bytes:
        raise ConfigError(
            f"--out {out}: {free / 1e6:.1f} MB free, but a checkpoint of this run takes about "
            f"{checkpoint_bytes / 1e6:.1f} MB: free some space or choose another directory"
        )


def clear_run_files(out: Path) -> None:
    """Delete what a run writes under ``out`` (nothing else)."""
    for name in _existing_run_files(out):
        path = out / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)  # another process may clear it too
        else:
            path.unlink(missing_ok=True)


def prepare_run_dir(
    out: str | os.PathLike, *, resume: bool, overwrite: bool, primary: bool = True
) -> None:
    """Check ``out`` before JAX starts: writable, and holding no run unless told what to do.

    ``primary``: this process clears the directory for ``--overwrite``, or of a run that
    wrote no checkpoint (process 0 of a multi-process run; the others only check). Raises
    ConfigError.
    """
    out = Path(out)
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite deletes it: give one")
    _check_writable(out)
    existing = _existing_run_files(out)
    if not existing:
        return
    held = holds_checkpoints(out)
    if held and not (resume or overwrite):
        raise ConfigError(
            f"--out {out} already holds a run ({', '.join(existing)}): add --resume to "
            "continue it, or --overwrite to delete it and start again"
        )
    if primary and not held and not overwrite:
        print(
            f"--out {out}: replacing the files of a run that wrote no checkpoint "
            f"({', '.join(existing)})",
            flush=True,
        )
    if primary and (overwrite or not held):
        clear_run_files(out)


def resume_point(out: str | os.PathLike, config: Config) -> RunStart:
    """The checkpoint a ``--resume`` run continues from, checked against ``config``.

    The newest checkpoint whose configuration can be read is checked; the training loop
    then restores the newest one whose state can be read, saying which it passes over.
    Reads checkpoint metadata through Orbax, which starts JAX's backends: in a
    multi-process run, call it after ``jax.distributed.initialize``.
    """
    out = Path(out)
    steps = checkpoint_steps(out)
    for step in steps:
        try:
            saved = saved_config(out, step)
        except Exception:  # unreadable: the loop says why when it passes over it
            continue
        changed = check_compatible(saved, config, step)
        return RunStart(resume_step=steps[0], changed_fields=tuple(changed))
    return RunStart(resume_step=steps[0] if steps else None)
