"""Per-step metrics on the host: one JSON object per step, and the run's files.

``DIR/config.json`` holds the resolved configuration; ``DIR/metrics.jsonl`` one
line per step with at least ``step``, ``loss``, ``tokens_per_s``,
``dropped_fraction`` and ``expert_imbalance``; ``DIR/tensorboard`` the same rows and
configuration for TensorBoard (:mod:`jaxmoe.train.logs.tensorboard`);
``DIR/schedule_report.json`` what the scheduling layer did to the step, when it ran.
Only process 0 writes.

``metrics.jsonl`` is strict JSON: a non-finite value is written as ``null``. Each
line is written whole or not at all (:mod:`jaxmoe.train.logs.appends`: a failed write, a
full disk say, is cut off again), so every line of the file parses.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxmoe.config import Config
from jaxmoe.train.logs import tensorboard
from jaxmoe.train.logs.appends import append_whole

METRICS_FILE = "metrics.jsonl"


def host_row(step: int, metrics: dict[str, Any], seconds: float, tokens: int) -> dict[str, Any]:
    """Device metrics of one step as plain JSON-ready values, with throughput added."""
    row: dict[str, Any] = {"step": step}
    for name, value in jax.device_get(metrics).items():
        value = np.asarray(value)
        row[name] = value.tolist() if value.ndim else value.item()
    row["step_time_s"] = seconds
    row["tokens_per_s"] = tokens / seconds
    return row


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file (every line parses: they are written whole)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


class RunLog:
    """Writes the run's configuration and metrics under ``out_dir`` (process 0 only), to
    ``metrics.jsonl`` and for TensorBoard.

    ``first_step`` is where this invocation starts: a resumed run keeps the rows of the
    steps before it and drops any later ones (work done after its checkpoint, which the
    resumed run does again).
    """

    def __init__(self, out_dir: str | Path | None, config: Config, first_step: int = 0):
        self.active = out_dir is not None and jax.process_index() == 0
        self._fd: int | None = None
        self._board: tensorboard.TensorBoardLog | None = None
        if not self.active:
            return
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        path = self.out_dir / METRICS_FILE
        kept = [row for row in read_rows(path) if row["step"] < first_step]
        staging = path.with_suffix(".jsonl.tmp")
        staging.write_text("".join(json.dumps(row) + "\n" for row in kept))
        staging.replace(path)  # atomic: the old file or the new one, never a mix
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._board = tensorboard.TensorBoardLog(
            tensorboard.log_dir(self.out_dir), config, first_step
        )

    def write_schedule_report(self, report: Any) -> None:
        """``schedule_report.json``: what the scheduling layer did to the step, and
        ``schedule_timeline.json``: its simulated timeline (open in Perfetto's UI), and
        ``schedule_timeline.png`` drawn from it when matplotlib is installed."""
        import scheduling

        if self.active:
            report.save(self.out_dir / "schedule_report.json")
            report.save_trace(self.out_dir / "schedule_timeline.json")
            if scheduling.gantt_available():
                report.save_gantt(self.out_dir / "schedule_timeline.png")

    def write_grad_sync_choice(self, choice: Any) -> None:
        """``grad_sync_choice.json``: what ``train.grad_sync auto`` chose and why."""
        if self.active:
            choice.save(self.out_dir / "grad_sync_choice.json")

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` as one line, whole, and as TensorBoard summaries; raises OSError
        when either cannot be written (what was written of it is cut back)."""
        if self._fd is None:
            return
        append_whole(self._fd, (json.dumps(strict_json(row), allow_nan=False) + "\n").encode())
        self._board.write(row)

    def flush(self) -> None:
        """Put every row written so far on disk (at a checkpoint)."""
        if self._fd is not None:
            os.fsync(self._fd)
            self._board.flush()

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                self._board.close()
            finally:
                os.close(fd)
