"""Parallel folding in the planner: published MoE shapes, and the best folded mapping
against the best mapping whose MoE reuses attention's layout.

The models are the published architectures (jaxmoe/presets/). The planner estimates
them from shallow traces (two and three blocks; two and eight under ``pair``:
:mod:`jaxmoe.plan.layer_extrapolation`), so every mapping on 64-256 devices is planned in
seconds; ``experiments.folding_scale`` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxmoe.config import Config
from jaxmoe.plan.mappings import Mapping
from jaxmoe.presets import preset

if TYPE_CHECKING:  # the planner imports JAX
    from jaxmoe.plan.planner import MappingEstimate

# Sequence length of the planned runs, chosen here (the models' pretraining length).
SEQ_LEN = 4096
# Sequences per step and device, chosen here: one, Megatron-Core's usual micro-batch. A
# step of N devices then holds N sequences (one micro-batch round unless the planner
# splits it into microbatches, so the step synchronises gradients every round).
SEQUENCES_PER_DEVICE = 1


def planned_config(model: str, devices: int, batch: int | None = None, **model_fields) -> Config:
    """``model``'s published shape with ``batch`` sequences a step (default: those of
    ``devices`` devices), and any model field overridden (e.g. ``recompute``)."""
    values = MODELS[model].to_dict()
    values["train"]["batch_size"] = batch or devices * SEQUENCES_PER_DEVICE
    values["model"].update(model_fields)
    return Config.from_dict(values)


# The models' true architectures (jaxmoe/presets/: the shapes and blocks as each model's
# config.json on the Hugging Face hub gives them: grouped-query attention, SwiGLU experts,
# Qwen2's gated shared expert), with bfloat16 activations, sequences of SEQ_LEN tokens
# and capacity factor 1.0 (chosen here).
MODELS: dict[str, Config] = {
    "mixtral-8x22b": preset("mixtral-8x22b"),
    "qwen2-57b-a14b": preset("qwen2_moe-57b-a14b"),
}


def reuses_attention_layout(mapping: Mapping) -> bool:
    """Whether the MoE layout is attention's own (no folding).

    Precisely: ``expert_tensor == tensor``, so each expert-tensor group is exactly one
    attention tensor group (both are the innermost ``tensor`` devices of the numbering,
    :mod:`jaxmoe.config.layout`), and the expert group, the next ``expert`` such groups, lies
    inside attention's data axis: its devices differ only in their attention data index,
    never in their tensor index (Megatron-Core without folding: EP divides DP, ETP = TP).
    A folded mapping is any valid one; it may also put the expert group across the
    tensor axis (``expert_tensor < tensor``) or split experts wider (``expert_tensor >
    tensor``)."""
    return mapping.expert_tensor == mapping.tensor


@dataclass(frozen=True)
class FoldingComparison:
    """The best folded mapping and the best reusing one of one plan (None: none fits)."""

    model: str
    devices: int
    best_folded: MappingEstimate | None
    best_reused: MappingEstimate | None

    @property
    def speedup(self) -> float | None:
        """Step time of the best reusing mapping over the best folded one."""
        if self.best_folded is None or self.best_reused is None:
            return None
        return self.best_reused.best.step / self.best_folded.best.step


def compare_folding(
    model: str, ranked: Sequence[MappingEstimate], devices: int | None = None
) -> FoldingComparison:
    """From a plan's ranked estimates (those that fit memory, best MFU first) on
    ``devices`` devices (default: the first estimate's; 0 when there is none)."""
    reused = [e for e in ranked if reuses_attention_layout(e.mapping)]
    if devices is None:
        devices = ranked[0].mapping.devices if ranked else 0
    return FoldingComparison(
        model, devices, ranked[0] if ranked else None, reused[0] if reused else None
    )


def plan_and_compare(
    model: str,
    devices: int,
    profile: str = "h100-8x-nvlink-3200g",
    schedules: Sequence[str] = ("none",),
    config: Config | None = None,
) -> FoldingComparison:
    """Plan every mapping of ``model`` (or ``config``) on ``devices`` devices and compare."""
    from jaxmoe.plan.estimates import default_cache_dir
    from jaxmoe.plan.planner import plan_mappings

    config = config or planned_config(model, devices)
    # Every layout at the model's own options: a comparison of layouts alone.
    result = plan_mappings(
        config,
        model,
        devices,
        profile,
        schedules,
        cache_dir=default_cache_dir(),
        top=10**6,
        options=False,
        pipeline=False,
        cross_node_tensor=True,
    )
    return compare_folding(model, result.ranked, devices)


def comparison_table(comparisons: Sequence[FoldingComparison]) -> list[str]:
    lines = [
        "| model | devices | mapping | step ms | MFU | GB/device |",
        "|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        for kind, estimate in (("folded", c.best_folded), ("reused", c.best_reused)):
            if estimate is None:
                lines.append(f"| {c.model} | {c.devices} | best {kind}: none fits | | | |")
                continue
            lines.append(
                f"| {c.model} | {c.devices} | best {kind}: {estimate.mapping.label()} | "
                f"{estimate.best.step * 1e3:.1f} | {estimate.mfu:.1%} | "
                f"{estimate.memory.total / 1e9:.1f} |"
            )
    return lines
