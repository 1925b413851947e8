"""A measured trace of chosen training steps: ``jaxmoe train --profile-steps A:B``.

:class:`StepProfiler` starts a :mod:`jax.profiler` trace just before step A
and stops it after step B, once all of B's device work has finished, so the
trace holds the real execution of steps A..B and nothing of compilation. Each
traced step is marked with a ``StepTraceAnnotation`` (XProf's step view).

``jax.profiler`` is given the run's TensorBoard log directory, ``DIR/tensorboard``
(:mod:`jaxmoe.train.logs.tensorboard`), and writes under its ``plugins/profile/<session>/``:
``<host>.xplane.pb`` for XProf (TensorBoard's profile plugin, which looks there) and
``<host>.trace.json.gz``, Chrome trace events that https://ui.perfetto.dev opens. In a
multi-process run each process traces its own devices, process 0 into that directory
and process ``i`` into ``DIR/tensorboard/process_<i>`` (a log directory of its own:
processes on one host would write the same file names).

:func:`compare_with_trace` is ``jaxmoe schedule --trace``: the planned step's
estimated op times beside those measured in such a trace
(:mod:`scheduling.reports.measured_trace` says how ops are matched).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax

import scheduling
from jaxmoe.config import ConfigError
from jaxmoe.train.logs import tensorboard
from jaxmoe.train.scheduled import TrainStep


def parse_profile_steps(text: str, steps: int, out_dir: str | Path | None) -> tuple[int, int]:
    """``'A:B'`` as ``(A, B)``, checked against the run; raises ConfigError naming the flag."""
    first, separator, last = text.partition(":")
    try:
        if not separator:
            raise ValueError
        window = (int(first), int(last))
    except ValueError:
        raise ConfigError(
            f"--profile-steps {text!r}: expected A:B, the first and last step to trace (e.g. 3:5)"
        ) from None
    check_profile_steps(window, steps, out_dir)
    return window


def check_profile_steps(window: tuple[int, int], steps: int, out_dir: str | Path | None) -> None:
    """Refuse a window outside the run's steps, or one with nowhere to write the trace."""
    first, last = window
    if not 0 <= first <= last < steps:
        raise ConfigError(
            f"--profile-steps {first}:{last}: need 0 <= A <= B < {steps} (the run's steps, "
            "counted from 0)"
        )
    if out_dir is None:
        raise ConfigError(
            f"--profile-steps {first}:{last} needs --out DIR: the trace is written to "
            f"DIR/{tensorboard.TENSORBOARD_DIR}"
        )


def profile_dir(out_dir: str | Path) -> Path:
    """The log directory this process gives ``jax.profiler``."""
    directory = tensorboard.log_dir(out_dir)
    if jax.process_index() > 0:
        directory /= f"process_{jax.process_index()}"
    return directory


class StepProfiler:
    """Traces steps ``window[0]..window[1]``; with ``window=None`` it does nothing.

    The loop calls :meth:`before_step` and :meth:`after_step` around each step
    and enters the profiler as a context, which stops a trace that an error
    left running.
    """

    def __init__(self, window: tuple[int, int] | None, steps: int, out_dir: str | Path | None):
        if window is not None:
            check_profile_steps(window, steps, out_dir)
        self.window = window
        self.directory = None if window is None else profile_dir(out_dir)
        self._annotation: Any = None
        self._tracing = False

    def before_step(self, step: int) -> None:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        if step == self.window[0]:
            # The step before may still be running (its metrics come back first).
            jax.block_until_ready(jax.live_arrays())
            jax.profiler.start_trace(self.directory)
            self._tracing = True
        self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
        self._annotation.__enter__()

    def after_step(self, step: int) -> None:
        if not self._tracing:
            return
        self._end_annotation()
        if step == self.window[1]:
            # Everything the traced steps dispatched must have run before the trace ends:
            # waiting on every live array waits on every step output.
            jax.block_until_ready(jax.live_arrays())
            self._stop()

    def _end_annotation(self) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None

    def _stop(self) -> None:
        self._tracing = False
        jax.profiler.stop_trace()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._end_annotation()
        if self._tracing:
            self._stop()


def find_trace(path: str | Path) -> Path:
    """The newest ``*.trace.json.gz`` at or under ``path``; ConfigError if there is none."""
    try:
        return scheduling.find_trace_file(path)
    except FileNotFoundError:
        raise ConfigError(
            f"--trace {path}: no *.trace.json.gz there; write one with "
            "jaxmoe train --profile-steps A:B --out DIR (it goes under DIR/tensorboard)"
        ) from None


def compare_with_trace(planned: TrainStep, trace: Path, out_dir: str | Path | None) -> str:
    """The table of ``planned``'s op estimates against the op times measured in ``trace``.

    ``planned`` must be scheduled (it has a report), and the trace must come from a
    run of the same configuration and schedule (the table warns when the compiled
    module lacks op names of the trace). With ``out_dir``, writes
    ``trace_comparison.json`` and ``measured_vs_simulated.json`` (both timelines
    in one Chrome trace).
    """
    measured = scheduling.read_trace(trace)
    hlo_text = planned.step.lower(*planned.example).compile().as_text()
    report = planned.report
    comparison = scheduling.compare_trace(measured, hlo_text, report.trace, report.step_seconds)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "trace_comparison.json").write_text(
            json.dumps(comparison.to_json(), indent=2) + "\n"
        )
        both = scheduling.side_by_side(report.trace, measured)
        (out / "measured_vs_simulated.json").write_text(json.dumps(both) + "\n")
    return comparison.table()
