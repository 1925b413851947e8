"""Parallel folding in the planner: published MoE shapes, and the best folded mapping
against the best mapping whose MoE reuses attention's layout.

The model shapes are the published ones (layers, width, heads, experts, top-k, expert
width); what jaxmoe's model cannot express is listed with each. The planner estimates
them from one- and two-layer traces (:mod:`jaxmoe.plan.layer_extrapolation`), so every
mapping on 64-256 devices is planned in seconds; ``experiments.folding_scale`` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxmoe.config import Config, ModelConfig, MoEConfig, TrainConfig
from jaxmoe.plan.mappings import Mapping

if TYPE_CHECKING:  # the planner imports JAX
    from jaxmoe.plan.planner import MappingEstimate

# Sequence length of the planned runs, chosen here (the models' pretraining length).
SEQ_LEN = 4096
# Sequences per step and device, chosen here: one, Megatron-Core's usual micro-batch. A
# step of N devices then holds N sequences (jaxmoe has no gradient accumulation, so the
# step is one micro-batch round and synchronises gradients every time).
SEQUENCES_PER_DEVICE = 1


def _published(
    *, layers: int, width: int, heads: int, experts: int, top_k: int, expert_width: int,
    vocab: int
) -> Config:  # fmt: skip
    """Every layer an MoE layer (as in both models), bfloat16 activations; capacity
    factor 1.0 is chosen here."""
    return Config(
        model=ModelConfig(
            vocab_size=vocab,
            d_model=width,
            num_heads=heads,
            num_layers=layers,
            d_ff=expert_width,  # no dense FFN layer: moe_every=1
            seq_len=SEQ_LEN,
            moe_every=1,
            dtype="bfloat16",
        ),
        moe=MoEConfig(num_experts=experts, top_k=top_k, capacity_factor=1.0, d_expert=expert_width),
        train=TrainConfig(batch_size=8 * SEQUENCES_PER_DEVICE),  # see planned_config
    )


def planned_config(model: str, devices: int, **model_fields) -> Config:
    """``model``'s published shape with the batch of ``devices`` devices, and any model
    field overridden (e.g. ``recompute``)."""
    values = MODELS[model].to_dict()
    values["train"]["batch_size"] = devices * SEQUENCES_PER_DEVICE
    values["model"].update(model_fields)
    return Config.from_dict(values)


# The shapes as each model's config.json on the Hugging Face hub gives them.
MODELS: dict[str, Config] = {
    # mistral-community/Mixtral-8x22B-v0.1 config.json: num_hidden_layers 56, hidden_size
    # 6144, num_attention_heads 48 (num_key_value_heads 8), num_local_experts 8,
    # num_experts_per_tok 2, intermediate_size 16384, vocab_size 32000.
    # Left out: grouped-query attention (8 KV heads; here every head has its own K, V)
    # and SwiGLU experts (three matrices; here two).
    "mixtral-8x22b": _published(
        layers=56, width=6144, heads=48, experts=8, top_k=2, expert_width=16384, vocab=32000
    ),
    # Qwen/Qwen2-57B-A14B config.json: num_hidden_layers 28, hidden_size 3584,
    # num_attention_heads 28 (num_key_value_heads 4), num_experts 64, num_experts_per_tok 8,
    # moe_intermediate_size 2560, decoder_sparse_step 1, vocab_size 151936.
    # Left out: the shared expert (shared_expert_intermediate_size 20480, in every layer),
    # grouped-query attention and SwiGLU experts.
    "qwen2-57b-a14b": _published(
        layers=28, width=3584, heads=28, experts=64, top_k=8, expert_width=2560, vocab=151936
    ),
}


def reuses_attention_layout(mapping: Mapping) -> bool:
    """Whether the MoE layout is attention's own (no folding).

    Precisely: ``expert_tensor == tensor``, so each expert-tensor group is exactly one
    attention tensor group (both are the innermost ``tensor`` devices of the numbering,
    :mod:`jaxmoe.parallel.layout`), and the expert group, the next ``expert`` such groups, lies
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
    from jaxmoe.plan.planner import default_cache_dir, plan_mappings

    config = config or planned_config(model, devices)
    result = plan_mappings(
        config, model, devices, profile, schedules, cache_dir=default_cache_dir()
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
