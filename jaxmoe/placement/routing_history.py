"""The smoothed routing history the placement planner plans from.

Each step's routing metrics (``tokens_per_expert``, ``kept_by_copies``) are folded into an
exponentially weighted mean, and the last ``RECENT_STEPS`` steps are kept as they were:
:meth:`RoutingHistory.predict` blends the last step with the mean, and
:meth:`RoutingHistory.recent` gives the steps a table is judged on under the balanced
split (:mod:`jaxmoe.placement.planner`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# How the next steps' routing is predicted, per metric: ``(half_life, latest)``, the
# prediction being ``latest x the last step + (1 - latest) x the exponentially weighted
# mean whose step weights halve every half_life steps``: the best linear prediction of a
# series that returns to its mean, as routing does under the balancing losses, when
# ``latest`` is its correlation with the next step. Measured on the routing of 300-step
# `tiny` runs (experiments/results/dropless_eval.md, the placement replays): each expert's
# share of the routed assignments moves around a persistent mean, correlated about 0.8
# with the next step and under 0.2 five steps later. Planned from this blend, the device
# load's excess (dropless) is lower than planned from the last step alone or from the mean
# alone, and the drops (capacity) as low as from the last step alone; weights of 0.7-0.9
# and half-lives of 8-128 steps plan alike there, within the runs' noise.
SMOOTHING = {"tokens_per_expert": (64.0, 0.8), "kept_by_copies": (64.0, 0.8)}
# Under the balanced split (dropless), a table is judged on the routing of this many last
# steps.
RECENT_STEPS = 16


class RoutingHistory:
    """The routing metrics of the steps seen so far, smoothed: for each metric of
    ``smoothing`` (``{key: (half_life, latest)}``, default :data:`SMOOTHING`) an
    exponentially weighted mean (a step's weight halves every ``half_life`` steps) and the
    last step, blended by :meth:`predict`. A window that starts at or before the last step
    seen (a new run, a resumed one) starts the history again."""

    def __init__(self, smoothing: dict[str, tuple[float, float]] | None = None):
        self.smoothing = dict(SMOOTHING if smoothing is None else smoothing)
        for key, (half_life, latest) in self.smoothing.items():
            if not half_life > 0 or not 0 <= latest <= 1:
                raise ValueError(
                    f"smoothing[{key!r}]=({half_life}, {latest}): the half-life must be > 0 "
                    "steps and the last step's weight in [0, 1]"
                )
        self._restart()

    def _restart(self) -> None:
        self.last_step: int | None = None
        self._sums: dict[str, np.ndarray] = {}
        self._weights: dict[str, float] = {}
        self._recent: dict[str, list[np.ndarray]] = {}

    def update(self, rows: list[dict[str, Any]]) -> None:
        """Fold in the metrics of ``rows`` (one per step)."""
        rows = sorted(rows, key=lambda row: row["step"])
        if rows and self.last_step is not None and rows[0]["step"] <= self.last_step:
            self._restart()
        for row in rows:
            for key, (half_life, _) in self.smoothing.items():
                if key in row:
                    decay = 0.5 ** (1.0 / half_life)
                    value = np.asarray(row[key], np.float64)
                    self._sums[key] = decay * self._sums.get(key, 0.0) + value
                    self._weights[key] = decay * self._weights.get(key, 0.0) + 1.0
                    self._recent[key] = [*self._recent.get(key, [])[1 - RECENT_STEPS :], value]
            self.last_step = row["step"]

    def mean(self, key: str) -> np.ndarray:
        """The exponentially weighted mean of metric ``key`` per step."""
        if key not in self._sums:
            raise KeyError(f"no step with {key!r} seen yet")
        return self._sums[key] / self._weights[key]

    def predict(self, key: str) -> np.ndarray:
        """The next step's metric ``key``: the last step and the mean, blended."""
        latest = self.smoothing[key][1]
        return latest * self._recent[key][-1] + (1.0 - latest) * self.mean(key)

    def recent(self, key: str) -> np.ndarray:
        """``[steps, ...]``: metric ``key`` of the last ``RECENT_STEPS`` steps seen."""
        if key not in self._recent:
            raise KeyError(f"no step with {key!r} seen yet")
        return np.stack(self._recent[key])
