"""Per-step metrics on the host: one JSON object per step, and the run's files.

``DIR/config.json`` holds the resolved configuration; ``DIR/metrics.jsonl`` one
line per step with at least ``step``, ``loss``, ``tokens_per_s``,
``dropped_fraction`` and ``expert_imbalance``; ``DIR/schedule_report.json`` what
the scheduling layer did to the step, when it ran. Only process 0 writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxmoe.config import Config


def host_row(step: int, metrics: dict[str, Any], seconds: float, tokens: int) -> dict[str, Any]:
    """Device metrics of one step as plain JSON-ready values, with throughput added."""
    row: dict[str, Any] = {"step": step}
    for name, value in jax.device_get(metrics).items():
        value = np.asarray(value)
        row[name] = value.tolist() if value.ndim else value.item()
    row["step_time_s"] = seconds
    row["tokens_per_s"] = tokens / seconds
    return row


class RunLog:
    """Writes the run's configuration and metrics under ``out_dir`` (process 0 only)."""

    def __init__(self, out_dir: str | Path | None, config: Config):
        self.active = out_dir is not None and jax.process_index() == 0
        self._metrics = None
        if not self.active:
            return
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        self._metrics = (self.out_dir / "metrics.jsonl").open("w")

    def write_schedule_report(self, report: Any) -> None:
        """``schedule_report.json``: what the scheduling layer did to the step, and
        ``schedule_timeline.json``: its simulated timeline (open in Perfetto's UI), and
        ``schedule_timeline.png`` drawn from it when matplotlib is installed."""
        from scheduling import gantt

        if self.active:
            report.save(self.out_dir / "schedule_report.json")
            report.save_trace(self.out_dir / "schedule_timeline.json")
            if gantt.available():
                report.save_gantt(self.out_dir / "schedule_timeline.png")

    def write(self, row: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
