"""The training loop: data, state, compiled steps, periodic validation, logging."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from jaxmoe.config import Config, ConfigError
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.data import BatchSampler, TokenSplits, load_tokens, put_on_mesh
from jaxmoe.train.metrics import RunLog, host_row
from jaxmoe.train.profiler import StepProfiler
from jaxmoe.train.scheduled import plan_train_step
from jaxmoe.train.state import init_train_state
from jaxmoe.train.step import build_eval_step
from jaxmoe.train.watchdog import StepWatchdog


def _evaluate(eval_step: Callable, params: Any, sampler: BatchSampler, batches: int, mesh) -> float:
    """Mean validation cross-entropy over a fixed set of batches (the same every time)."""
    losses = [eval_step(params, put_on_mesh(sampler, index, mesh)) for index in range(batches)]
    return float(sum(jax.device_get(losses)) / batches)


def train(
    config: Config,
    out_dir: str | Path | None = None,
    *,
    progress: bool = True,
    step_timeout_s: float | None = None,
    profile_steps: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Train ``config`` for ``config.train.steps`` steps; returns one metrics row per step.

    With ``step_timeout_s``, a step (or validation pass) that takes longer ends the
    process (see :mod:`jaxmoe.train.watchdog`): in a multi-process run, a peer died.
    With ``profile_steps=(A, B)``, steps A..B are traced (:mod:`jaxmoe.train.profiler`).
    """
    profiler = StepProfiler(profile_steps, config.train.steps, out_dir)
    mesh = build_mesh(config.parallel)
    seq_len, batch = config.model.seq_len, config.train.batch_size
    splits = TokenSplits(load_tokens(config.data), config.data.val_fraction, seq_len)
    if splits.max_token_id >= config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size}, but the data holds token id "
            f"{splits.max_token_id}: use a vocabulary of at least {splits.max_token_id + 1}"
        )
    train_batches = BatchSampler(splits.train, seq_len, batch, config.train.seed)
    val_batches = BatchSampler(splits.val, seq_len, batch, config.train.seed + 1)

    state = init_train_state(config, mesh)
    first_batch = put_on_mesh(train_batches, 0, mesh)
    planned = plan_train_step(config, mesh)
    # Compiled ahead so that the first step's time is a step, not a compilation.
    train_step = planned.compile()
    eval_step = build_eval_step(config, mesh).jit().lower(state.params, first_batch).compile()

    log = RunLog(out_dir, config)
    if planned.report is not None:
        log.write_schedule_report(planned.report)
        if progress and jax.process_index() == 0:
            print(planned.report.table(max_rows=24), flush=True)
    rows: list[dict[str, Any]] = []
    bar = tqdm(
        total=config.train.steps,
        disable=not progress or jax.process_index() != 0,
        desc="train",
        unit="step",
    )
    with StepWatchdog(step_timeout_s) as watchdog, contextlib.closing(log), bar, profiler:
        for step in range(config.train.steps):
            profiler.before_step(step)
            started = time.perf_counter()
            batch_array = first_batch if step == 0 else put_on_mesh(train_batches, step, mesh)
            with watchdog.step(step):
                state, metrics = train_step(state, batch_array)
                metrics = jax.device_get(metrics)  # waits for the step
            row = host_row(step, metrics, time.perf_counter() - started, batch * seq_len)
            profiler.after_step(step)
            last = step + 1 == config.train.steps
            if (step + 1) % config.train.eval_every == 0 or last:
                with watchdog.step(step):
                    row["val_loss"] = _evaluate(
                        eval_step, state.params, val_batches, config.train.eval_batches, mesh
                    )
                if jax.process_index() == 0:
                    bar.write(f"step {step + 1}: val_loss {row['val_loss']:.4f}")
            rows.append(row)
            log.write(row)
            bar.set_postfix(
                loss=f"{row['loss']:.3f}",
                dropped=f"{row['dropped_fraction']:.2f}",
                tok_s=f"{row['tokens_per_s']:.0f}",
            )
            bar.update()
    return rows
