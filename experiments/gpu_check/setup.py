"""What every section of the GPU check runs with (the sizes of a GPU run and of the dry
run, the device, the output folder, its time budget) and how a section records a figure:
a median with its range, an error as one line of text."""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.shared.spread import Spread

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results" / "gpu_check"
TOTAL_S = 430  # the whole run, startup aside, within 8 minutes


@dataclass(frozen=True)
class Sizes:
    """The shapes and repeats of a run: the GPU's, or the dry run's tiny ones."""

    limits: dict[str, float]  # seconds per section
    # attention: batch, sequence, query heads, key/value heads, head width; dtype; tiles
    attention: tuple[int, int, int, int, int]
    attention_dtype: str
    blocks: tuple[int, ...]
    dense_max_score_bytes: int  # dense core (and the reference) only below this
    rounds: int
    repeats: int  # calls per core per round
    # gemm: (m, k, n) products, and the FLOPs one call aims at
    gemms: tuple[tuple[int, int, int], ...]
    gemm_call_flops: float
    gemm_measure_flops: float  # calls per measurement, queued, to take at least this
    gemm_rounds: int
    # fp8: one expert block's (experts, tokens a slot, d_model, hidden width)
    expert_block: tuple[int, int, int, int]
    # step
    step_preset: str
    step_model: dict[str, Any]
    step_batches: tuple[int, ...]  # candidates, the largest that fits is taken
    step_memory_bytes: float
    step_batch_unwalked: int  # the batch where the memory walk fails
    warmup: int
    steps: int


GPU = Sizes(
    limits={"attention": 90, "gemm": 60, "fp8": 40, "step": 110, "schedule": 130},
    attention=(1, 4096, 32, 8, 128),
    attention_dtype="bfloat16",
    blocks=(512, 1024),
    dense_max_score_bytes=4 << 30,
    rounds=10,
    repeats=3,
    gemms=(
        (1024, 1024, 1024),
        (2048, 2048, 2048),
        (4096, 4096, 4096),
        (8192, 8192, 8192),
        (4096, 4096, 14336),
        (16384, 6144, 16384),
    ),
    gemm_call_flops=4e12,
    gemm_measure_flops=2e13,
    gemm_rounds=7,
    expert_block=(8, 2048, 4096, 14336),
    step_preset="mixtral-8x7b",
    # Mixtral 8x7B's widths, cut to two blocks (its state alone is 23 GB a block).
    step_model=dict(num_layers=2, seq_len=4096, attention="auto"),
    step_batches=(1, 2, 4, 8, 16, 32),
    # The rest of the GPU is left to the schedule section's process.
    step_memory_bytes=80e9,
    step_batch_unwalked=4,  # the walk's 62 GB on a CPU host (the blockwise core)
    warmup=2,
    steps=10,
)
DRY = Sizes(
    limits={"attention": 60, "gemm": 30, "fp8": 30, "step": 60, "schedule": 5},
    attention=(1, 64, 4, 2, 16),
    attention_dtype="float32",
    blocks=(16,),  # one block size: the others are figures of the GPU run, not paths
    dense_max_score_bytes=1 << 20,
    rounds=1,
    repeats=1,
    gemms=((64, 128, 256),),  # one shape, not square: every shape takes one path
    gemm_call_flops=1e6,
    gemm_measure_flops=1e6,
    gemm_rounds=1,
    expert_block=(2, 16, 32, 64),
    step_preset="tiny",
    step_model=dict(num_layers=2, seq_len=32, attention="auto"),
    step_batches=(1, 2),
    step_memory_bytes=1e9,
    step_batch_unwalked=2,
    warmup=1,
    steps=2,
)


class SectionTimeout(Exception):
    """A section ran past its time limit."""


@dataclass
class Budget:
    """A section's time: its deadline, and whether something of ``seconds`` still fits."""

    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return self.left() > seconds


@dataclass(frozen=True)
class Setup:
    """What every section runs with."""

    dry: bool
    sizes: Sizes
    out: Path
    device: Any  # the one device every section runs on


def error_text(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(error)).strip()[:2000]


def spread_of(values: Sequence[float]) -> dict[str, Any]:
    spread = Spread.of(values)
    return {"median": spread.median, "low": spread.low, "high": spread.high, "values": values}


def as_spread(found: dict[str, Any]) -> Spread:
    return Spread(found["median"], found["low"], found["high"])


def ms_text(found: dict[str, Any] | None) -> str:
    return as_spread(found).format(scale=1e3, digits=3) if found else "-"


def ratio_text(found: dict[str, Any] | None) -> str:
    return as_spread(found).format(scale=1, digits=2) if found else "-"
