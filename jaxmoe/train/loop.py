"""The training loop: data, state, compiled steps, validation, logging, checkpoints.

A run ends in one of five ways: it finishes (checkpoint at the end); a stop signal
arrives while it starts (the process exits at once, see
:mod:`jaxmoe.train.run_control`) or while it trains (it finishes the step, writes a
checkpoint and raises :class:`RunStopped` with :data:`~jaxmoe.exit_codes.PREEMPTED`);
a step's loss or
gradient norm is not finite under ``train.on_nonfinite=stop`` (:class:`RunStopped`
with :data:`~jaxmoe.exit_codes.NONFINITE`, leaving the last good checkpoint as the latest);
or writing its files fails (:class:`RunStopped` with :data:`~jaxmoe.exit_codes.IO_ERROR`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from jaxmoe import exit_codes
from jaxmoe.config import Config
from jaxmoe.data.batches import BatchSampler, put_on_mesh
from jaxmoe.data.host_batches import DataPosition, HostBatches
from jaxmoe.data.mixture import load_mixture, run_batches
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.placement.planner import PlacementLog, plan_placement
from jaxmoe.plan.mfu import estimated_mfu, mfu_meter, no_peak_message
from jaxmoe.train.checkpoint import RunCheckpoints, saved_run
from jaxmoe.train.logs.metrics import METRICS_FILE, RunLog, host_row, read_rows
from jaxmoe.train.logs.profiler import StepProfiler
from jaxmoe.train.resolved import Run
from jaxmoe.train.run_control import StepWatchdog, StopSignals
from jaxmoe.train.scheduled import TrainStep, scheduled_train_step
from jaxmoe.train.state import init_train_state
from jaxmoe.train.step import build_eval_step


class RunStopped(Exception):
    """The run ended before its last step; ``status`` is the process exit status."""

    def __init__(self, message: str, status: int, rows: list[dict[str, Any]]):
        super().__init__(message)
        self.status = status
        self.rows = rows


def _evaluate(eval_step: Callable, state: Any, sampler: BatchSampler, batches: int, mesh) -> float:
    """Mean validation cross-entropy over a fixed set of batches (the same every time)."""
    losses = [
        eval_step(
            state.params, put_on_mesh(sampler, index, mesh), state.placement, state.model_state
        )
        for index in range(batches)
    ]
    return float(sum(jax.device_get(losses)) / batches)


def _write_failure(error: OSError) -> str:
    """Why a write failed, as a clause: ``no space left on device: <file>``, not
    ``[Errno 28] No space left on device``."""
    if not error.strerror:
        return str(error)
    reason = error.strerror[:1].lower() + error.strerror[1:]
    return f"{reason}: {error.filename}" if error.filename else reason


def _where_to_resume(checkpoints: RunCheckpoints | None, advice: str = "") -> str:
    step = None if checkpoints is None else checkpoints.latest_step()
    if step is None:
        return "no checkpoint was written"
    return (
        f"the last checkpoint is step {step} in {checkpoints.directory}: "
        f"continue with --resume{advice}"
    )


def _nonfinite(row: dict[str, Any]) -> bool:
    return not (math.isfinite(row["total_loss"]) and math.isfinite(row["grad_norm"]))


def _checkpoint_due(config: Config, done: int, stop: bool) -> bool:
    """Whether a checkpoint is saved after ``done`` steps."""
    every = config.train.checkpoint_every
    return stop or done == config.train.steps or bool(every and done % every == 0)


def _checkpoint(
    checkpoints: RunCheckpoints,
    state: Any,
    config: Config,
    done: int,
    stop: bool,
    data: DataPosition,
) -> float:
    """Save after ``done`` steps if it is time to; returns the seconds training waited.

    Periodic saves run in the background; the last one of a run (at its end or on a
    stop signal) is waited for, so the process never exits with a save half done.
    """
    started = time.perf_counter()
    final = stop or done == config.train.steps
    if _checkpoint_due(config, done, stop):
        checkpoints.save(state, data)
    if final:
        checkpoints.wait()
    return time.perf_counter() - started


def rebalance(
    state: Any,
    rows: list[dict[str, Any]],
    config: Config,
    done: int,
    log: PlacementLog,
    experimental: ExperimentalOptions = DEFAULT,
) -> Any:
    """After ``done`` steps, every ``moe.rebalance_every``: a new placement from the window's
    routing counts (``experimental``: the run's research options, ``Run.experimental``).
    The table is a step input: nothing recompiles."""
    every = config.moe.rebalance_every
    if not every or done % every or done == config.train.steps:
        return state
    window = [row for row in rows if row["step"] >= done - every]
    table, decisions = plan_placement(
        jax.device_get(state.placement), window, config, done, experimental=experimental
    )
    log.write(decisions)
    # The layout the step returns it in: an equal layout spelt otherwise would recompile.
    return state._replace(placement=jax.device_put(table, state.placement.sharding))


def _nonfinite_stop(
    row: dict[str, Any], checkpoints: RunCheckpoints | None, rows: list[dict[str, Any]]
) -> RunStopped:
    return RunStopped(
        f"step {row['step']}: the loss is {row['total_loss']} and the gradient norm "
        f"{row['grad_norm']}; stopped without keeping that update "
        "(--train.on_nonfinite skip would drop it and go on); "
        + _where_to_resume(
            checkpoints,
            " after a change against the divergence (a lower --train.learning_rate, for example)",
        ),
        exit_codes.NONFINITE,
        rows,
    )


@dataclass
class _Started:
    """What a run has once it has started: its state, data and compiled steps."""

    state: Any
    first_step: int
    train_batches: HostBatches  # this process's rows, read ahead
    val_batches: BatchSampler
    first_batch: jax.Array
    planned: TrainStep
    train_step: Callable[..., Any]
    eval_step: Callable[..., Any]


def _start(
    run: Run,
    checkpoints: RunCheckpoints | None,
    resume: bool,
    signals: StopSignals,
) -> _Started:
    """The state (restored from the newest readable checkpoint when resuming), the data and
    the compiled steps; a signal meanwhile ends the process at once."""
    config, mesh = run.config, run.mesh
    examples, val_batches = run_batches(config, load_mixture(config))
    restored = None
    if checkpoints is not None and resume:
        restored = signals.interruptible(checkpoints.restore_newest)
    if restored is not None:
        state, first_step = restored
        saved = saved_run(checkpoints.directory.parent, first_step).get("data", {})
        position = DataPosition.saved(saved, first_step, config.train.batch_size)
    else:
        state, first_step = signals.interruptible(lambda: init_train_state(run)), 0
        position = DataPosition()
    train_batches = HostBatches(examples, mesh, position, config.data.prefetch)
    first_batch = train_batches.next_on_mesh()
    planned = signals.interruptible(lambda: scheduled_train_step(run))
    # Compiled ahead so that the first step's time is a step, not a compilation.
    train_step = signals.interruptible(planned.compile)
    eval_step = signals.interruptible(
        lambda: (
            build_eval_step(run)
            .jit()
            .lower(state.params, first_batch, state.placement, state.model_state)
            .compile()
        )
    )
    return _Started(
        state,
        first_step,
        train_batches,
        val_batches,
        first_batch,
        planned,
        train_step,
        eval_step,
    )


def train(
    run: Run,
    out_dir: str | Path | None = None,
    *,
    progress: bool = True,
    step_timeout_s: float | None = None,
    resume: bool = False,
    profile_steps: tuple[int, int] | None = None,
    signals: StopSignals | None = None,
) -> list[dict[str, Any]]:
    """Train the prepared run (:func:`jaxmoe.prepare.prepare_run`) up to
    ``config.train.steps`` steps; returns this run's metric rows.

    With ``out_dir``, checkpoints are written there; with ``resume``, training continues
    from the newest one that can be read (a new run if there is none). With
    ``step_timeout_s``, a step (or validation pass) that takes longer ends the process
    (see :mod:`jaxmoe.train.run_control`): in a multi-process run, a peer died. With
    ``profile_steps=(A, B)``, steps A..B are traced (:mod:`jaxmoe.train.logs.profiler`).
    What ``train.grad_sync auto`` chose is logged with the run. ``signals``: the stop
    signals the caller installed when the process started (default: installed here).
    """
    with contextlib.ExitStack() as stack:
        if signals is None:
            signals = stack.enter_context(StopSignals(jax.process_count() > 1))
        return _train(run, out_dir, progress, step_timeout_s, resume, profile_steps, signals)


def _train(
    run: Run,
    out_dir: str | Path | None,
    progress: bool,
    step_timeout_s: float | None,
    resume: bool,
    profile_steps: tuple[int, int] | None,
    signals: StopSignals,
) -> list[dict[str, Any]]:
    config, mesh, grad_sync_choice = run.config, run.mesh, run.grad_sync_choice
    profiler = StepProfiler(profile_steps, config.train.steps, out_dir)
    seq_len, batch = config.model.seq_len, config.train.batch_size
    checkpoints = RunCheckpoints(out_dir, run) if out_dir is not None else None
    started = _start(run, checkpoints, resume, signals)
    state, first_step, planned = started.state, started.first_step, started.planned
    train_step, eval_step = started.train_step, started.eval_step

    primary = jax.process_index() == 0
    device_kind = mesh.devices.flat[0].device_kind
    meter = mfu_meter(config, mesh.devices.size, device_kind)
    # The planner's window may begin before a resumed run's first step.
    history = read_rows(Path(out_dir) / METRICS_FILE) if out_dir and first_step else []
    history = [row for row in history if row["step"] < first_step]
    log = RunLog(out_dir, config, first_step)
    if grad_sync_choice is not None:
        log.write_grad_sync_choice(grad_sync_choice)
        if primary:  # a decision made for the user: said even without progress output
            print(grad_sync_choice.table(), flush=True)
    placement_log = PlacementLog(out_dir, first_step, primary and config.moe.rebalance_every > 0)
    if planned.report is not None:
        log.write_schedule_report(planned.report)
        if progress and primary:
            print(planned.report.table(max_rows=24), flush=True)
            print(estimated_mfu(config, planned.report, mesh.devices.size).line(), flush=True)
            if mesh.devices.flat[0].platform == "gpu":  # XLA:GPU orders the module itself
                print(train_step.windows().line(), flush=True)
    if progress and primary:
        print(meter.describe() if meter else no_peak_message(config, device_kind), flush=True)
    if first_step and primary:
        print(f"resuming from the checkpoint of step {first_step}", flush=True)
    rows: list[dict[str, Any]] = []
    skipped = 0
    last_step = config.train.steps
    bar = tqdm(
        total=last_step,
        initial=first_step,
        disable=not progress or not primary,
        desc="train",
        unit="step",
    )
    signals.start_training()
    try:
        with (
            StepWatchdog(step_timeout_s) as watchdog,
            contextlib.closing(log),
            started.train_batches,
            checkpoints or contextlib.nullcontext(),
            bar,
            profiler,
        ):
            for step in range(first_step, last_step):
                profiler.before_step(step)
                started_s = time.perf_counter()
                batch_array = (
                    started.first_batch
                    if step == first_step
                    else started.train_batches.next_on_mesh()
                )
                with watchdog.step(step):
                    state, metrics = train_step(state, batch_array)
                    metrics = jax.device_get(metrics)  # waits for the step
                row = host_row(step, metrics, time.perf_counter() - started_s, batch * seq_len)
                if meter is not None:
                    row["mfu"] = meter(row["step_time_s"], row["dropped_fraction"])
                profiler.after_step(step)
                skipped += row.get("skipped", 0)
                if "skipped" in row:
                    row["skipped_steps"] = skipped
                if _nonfinite(row) and config.train.on_nonfinite == "stop":
                    rows.append(row)
                    log.write(row)
                    raise _nonfinite_stop(row, checkpoints, rows)
                done = step + 1
                if done % config.train.eval_every == 0 or done == last_step:
                    with watchdog.step(step):
                        row["val_loss"] = _evaluate(
                            eval_step, state, started.val_batches, config.train.eval_batches, mesh
                        )
                    if primary:
                        bar.write(f"step {done}: val_loss {row['val_loss']:.4f}")
                stop = signals.stop_after(done)
                state = rebalance(
                    state, [*history, *rows, row], config, done, placement_log, run.experimental
                )
                if checkpoints is not None:
                    row["checkpoint_s"] = _checkpoint(
                        checkpoints, state, config, done, stop, started.train_batches.position
                    )
                rows.append(row)
                log.write(row)
                if checkpoints is not None and _checkpoint_due(config, done, stop):
                    log.flush()  # the metrics on disk reach as far as the checkpoint
                bar.set_postfix(
                    loss=f"{row['loss']:.3f}",
                    dropped=f"{row['dropped_fraction']:.2f}",
                    tok_s=f"{row['tokens_per_s']:.0f}",
                )
                bar.update()
                if stop and done < last_step:
                    raise RunStopped(
                        f"stopped by a signal after {done} steps; {_where_to_resume(checkpoints)}",
                        exit_codes.PREEMPTED,
                        rows,
                    )
    except OSError as error:
        raise RunStopped(
            f"writing the run's files failed ({_write_failure(error)}); "
            f"{_where_to_resume(checkpoints)}",
            exit_codes.IO_ERROR,
            rows,
        ) from error
    return rows
