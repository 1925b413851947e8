"""Megatron-Core's published mappings of the seeds' models, estimated by jaxmoe's planner.

The recipes are Megatron-Core's MoE benchmark configurations for the two models of the MoE
Parallel Folding paper (arXiv 2504.14960), published by the paper's authors in their
Megatron MoE model zoo (github.com/yanring/Megatron-MoE-ModelZoo:
``runtime_configs/benchmarking/runtime.conf`` and ``model_configs/benchmarking/<model>.
yaml``): H100s, sequences of 4096 tokens, micro-batches of one sequence, a global batch
of 256, the distributed optimizer, sequence parallelism beside tensor parallelism, expert
tensor parallelism 1, the all-to-all dispatcher, no recomputation. The paper's own table
of settings is not reproduced here; these are its authors' settings for the same models
on the same GPUs.

Each is estimated as the planner estimates any mapping
(:func:`jaxmoe.plan.tracer.estimate_mapping`): the per-device step traced on an abstract
mesh, priced by the cost model and the two-stream simulator on the H100 profile (schedule
``none``), its memory walked; beside it, the same with full-layer recomputation.
``scale_eval`` sets them beside the planner's own search at the recipe's devices and
global batch.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from experiments.folding_models import planned_config
from jaxmoe.config import Config
from jaxmoe.plan.mappings import Mapping

if TYPE_CHECKING:  # the planner imports JAX
    from jaxmoe.plan.estimates import StepTime
    from jaxmoe.plan.memory import StepMemory

SOURCE = (
    "Megatron-Core's MoE benchmark recipes for these models, by the Parallel Folding "
    "paper's authors (github.com/yanring/Megatron-MoE-ModelZoo, "
    "runtime_configs/benchmarking/runtime.conf)"
)


@dataclass(frozen=True)
class Recipe:
    """One published mapping (micro-batch 1, expert tensor parallelism 1, the distributed
    optimizer, the all-to-all dispatcher)."""

    devices: int
    tensor: int  # TP, attention's (with sequence parallelism)
    pipeline: int  # PP
    virtual: int  # VPP: chunks of layers per stage
    expert: int  # EP
    global_batch: int = 256  # GBS, in sequences

    @property
    def data(self) -> int:
        """Attention's data-parallel replicas (DP)."""
        return self.devices // (self.pipeline * self.tensor)

    def mapping(self, recompute: str = "none") -> Mapping:
        """The recipe as a jaxmoe mapping: each data replica's rows in micro-batches of
        one sequence."""
        stage = self.devices // self.pipeline
        return Mapping(
            self.devices, self.tensor, stage // self.expert, self.expert, 1, "all_to_all",
            zero=1, recompute=recompute, microbatches=self.global_batch // self.data,
            pipeline=self.pipeline, virtual_stages=self.virtual,
        )  # fmt: skip

    def label(self) -> str:
        return (
            f"TP{self.tensor} PP{self.pipeline} VPP{self.virtual} EP{self.expert} ETP1 "
            f"(DP{self.data}), distributed optimizer, global batch {self.global_batch}"
        )


# The rows estimated for each recipe.
PUBLISHED_ROW = "as published"
RECOMPUTED_ROW = "with full-layer recomputation"

RECIPES = {
    "mixtral-8x22b": Recipe(devices=128, tensor=2, pipeline=8, virtual=1, expert=8),
    "qwen2-57b-a14b": Recipe(devices=64, tensor=2, pipeline=4, virtual=7, expert=4),
}


@dataclass(frozen=True)
class RecipeEstimate:
    """One row: what was estimated, and the estimate."""

    model: str
    row: str  # which variant
    mapping: Mapping
    memory: StepMemory | None  # None: not estimated (``left_out`` says why)
    time: StepTime | None
    mfu: float | None
    left_out: str = ""

    @property
    def idle_share(self) -> float:
        """The pipeline's idle ticks over its work: ``(P - 1) / (M V)`` (0: none)."""
        m = self.mapping
        return (m.pipeline - 1) / (m.microbatches * m.virtual_stages)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> RecipeEstimate:
        from jaxmoe.plan.estimates import StepTime
        from jaxmoe.plan.memory import StepMemory

        memory, time = data["memory"], data["time"]
        return RecipeEstimate(
            **{
                **data,
                "mapping": Mapping(**data["mapping"]),
                "memory": memory and StepMemory(**memory),
                "time": time and StepTime(**time),
            }
        )


def recipe_config(model: str) -> Config:
    """``model``'s published shape with its recipe's global batch."""
    recipe = RECIPES[model]
    return planned_config(model, recipe.devices, recipe.global_batch)


def recipe_mappings(model: str) -> list[tuple[str, Mapping]]:
    """The rows estimated for ``model``: its recipe as published and with full-layer
    recomputation."""
    recipe = RECIPES[model]
    return [(PUBLISHED_ROW, recipe.mapping()), (RECOMPUTED_ROW, recipe.mapping("layer"))]


def estimate_recipe_row(model: str, profile: str, row: str, mapping: Mapping) -> RecipeEstimate:
    """One row of :func:`recipe_mappings`, estimated on ``profile``."""
    import scheduling
    from jaxmoe.plan.estimates import EstimateCache
    from jaxmoe.plan.mappings import with_mapping
    from jaxmoe.plan.mfu import mfu
    from jaxmoe.plan.model_flops import model_flops
    from jaxmoe.plan.tracer import estimate_mapping

    recipe = RECIPES[model]
    config = recipe_config(model)
    device = scheduling.PROFILES[profile]
    peak = device.peak_flops_per_s(config.model.dtype)
    flops = model_flops(config).train_step()
    mapped = with_mapping(config, mapping, device.devices_per_node)
    memory, times = estimate_mapping(mapped, ("none",), profile, EstimateCache(None))
    time = times["none"]
    rate = mfu(flops, time.step, recipe.devices, peak)
    print(f"{model} {row}: {time.step * 1e3:.0f} ms, {memory.total / 1e9:.1f} GB", flush=True)
    return RecipeEstimate(model, row, mapping, memory, time, rate)


def estimate_in_fresh_process(
    model: str, profile: str, row: str, mapping: Mapping
) -> RecipeEstimate:
    """:func:`estimate_recipe_row` in a process of its own: a recipe's pipelined step
    unrolls hundreds of ticks, and the planner's runs fill this process's caches. A row
    whose process dies (out of memory) is left out, saying so."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        try:
            return pool.submit(estimate_recipe_row, model, profile, row, mapping).result()
        except BrokenProcessPool:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            reason = f"its trace needs more than this machine's {memory / 2**30:.0f} GiB"
            print(f"{model} {row}: not estimated, {reason}", flush=True)
            return RecipeEstimate(model, row, mapping, None, None, None, reason)
