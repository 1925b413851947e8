"""What one estimate of a mapped step holds (:class:`StepTime` per schedule, beside the
step's :class:`~jaxmoe.plan.memory.StepMemory`), and where estimates and bounds are kept
on disk between plans (:class:`EstimateCache`), keyed so that any change to the program
or the cost model estimates afresh (:mod:`jaxmoe.plan.planner` uses both)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import scheduling
from jaxmoe.config import Config
from jaxmoe.plan.bounds import Screen
from jaxmoe.plan.memory import StepMemory
from jaxmoe.train.resolved import op_cost_cache

# Modules that only present estimates: left out of the estimate cache's key.
PRESENTATION = frozenset({"cli.py", "plan_table.py"})


@dataclass(frozen=True)
class StepTime:
    """One schedule's simulated step (seconds)."""

    step: float
    compute: float
    communication: float
    exposed_communication: float
    # Gathered weights the schedule holds beyond the unscheduled step's memory walk, at
    # most: ZeRO-3 gathers started ahead of their use (bytes; 0 without split gathers).
    prefetched: int = 0


Estimate = tuple[StepMemory, dict[str, StepTime]]


def _source_digest() -> str:
    """Of everything an estimate depends on besides its inputs: the code and JAX (the
    command line and the table's layout aside)."""
    import jaxmoe

    digest = hashlib.sha256()
    for package in (jaxmoe, scheduling):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".json") and path.name not in PRESENTATION:
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    for name in ("jax", "jaxlib", "flax", "optax"):
        digest.update(f"{name}={importlib.metadata.version(name)}".encode())
    return digest.hexdigest()


class EstimateCache:
    """Estimates and bounds on disk: one file per (mapped config, profile, schedule,
    method: traced whole, extrapolated from shallow traces, or a screen's bounds)."""

    def __init__(self, root: Path | None):
        self.root = root
        self._digest = _source_digest() if root is not None else ""

    def _path(self, config: Config, schedule: str, method: str) -> Path:
        assert self.root is not None
        key = json.dumps([config.to_dict(), schedule, method, self._digest], sort_keys=True)
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def _read(self, config: Config, schedule: str, method: str) -> Any:
        if self.root is None:
            return None
        try:
            return json.loads(self._path(config, schedule, method).read_text())
        except (OSError, ValueError):
            return None

    def _write(self, config: Config, schedule: str, method: str, record: Any) -> None:
        if self.root is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self._path(config, schedule, method).write_text(json.dumps(record) + "\n")

    def load(
        self, config: Config, schedule: str, method: str
    ) -> tuple[StepMemory, StepTime] | None:
        data = self._read(config, schedule, method)
        try:
            return StepMemory(**data["memory"]), StepTime(**data["time"])
        except (KeyError, TypeError):
            return None

    def save(
        self, config: Config, schedule: str, method: str, memory: StepMemory, time: StepTime
    ) -> None:
        record = {"memory": dataclasses.asdict(memory), "time": dataclasses.asdict(time)}
        self._write(config, schedule, method, record)

    def load_screen(self, config: Config, schedule: str) -> Screen | None:
        data = self._read(config, schedule, "screen")
        try:
            return Screen.from_json(data)
        except (KeyError, TypeError):
            return None

    def save_screen(self, config: Config, schedule: str, found: Screen) -> None:
        self._write(config, schedule, "screen", found.to_json())


def default_cache_dir() -> Path:
    return op_cost_cache() / "plan"
