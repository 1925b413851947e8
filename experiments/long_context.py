"""Long sequences in the planner: Mixtral 8x22B at 32K and 128K tokens, with context
parallelism, on 128 and 256 H100s.

Each search keeps the tokens of a step at Megatron-Core's 4K recipe's (256 sequences of
4096, about a million tokens: 32 sequences of 32K, 8 of 128K), the recipe's tensor degree
(2, with sequence parallelism) and MoE layout (8 experts a group, whole experts, the
all-to-all dispatcher), and searches the context degree and its exchange, the ZeRO stage,
recomputation and microbatches, without a pipeline; the planner's context degrees are those
whose chunks hold at least 2048 positions (:data:`jaxmoe.plan.mappings.MIN_CONTEXT_CHUNK`).
The recipe's other choices stay fixed because a screen at these lengths is a minute's
trace, and every attention layout would take hours here.

Routing groups are :data:`GROUP_SIZE` consecutive tokens, inside every device's share of
a sequence (its chunks hold at least 2048 positions, and tensor parallelism 2 splits them
in two): each device plans its own tokens' capacity, as Megatron-Core does. Groups of a
whole 32K sequence would be planned from choices gathered over the sequence group, each
device's buffers sized for its share of a group's capacity (the same drops as one
device, at the price of buffers several times the routed tokens).
``experiments.scale_eval --parts long`` runs them and reports them beside the 4K searches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from experiments.folding_models import SEQ_LEN, planned_config

if TYPE_CHECKING:
    from experiments.scale_eval import Search
    from jaxmoe.config import Config
    from jaxmoe.plan.mappings import Mapping

MODEL = "mixtral-8x22b"
# (sequence length, devices) of each search.
SETTINGS = ((32768, 128), (131072, 256))
# Tokens a step: Megatron-Core's recipe's, 256 sequences of 4096.
TOKENS_PER_STEP = 256 * SEQ_LEN
# The recipe's tensor degree and MoE layout, kept: the expert group and the dispatcher.
TENSOR = 2
EXPERT_GROUP = 8
# Tokens a routing group (module docstring).
GROUP_SIZE = 2048


def sequences(seq_len: int) -> int:
    """Sequences a step at ``seq_len`` tokens each."""
    return TOKENS_PER_STEP // seq_len


def config(seq_len: int, devices: int) -> Config:
    """The model at ``seq_len`` tokens a sequence on ``devices`` devices, its routing groups
    of :data:`GROUP_SIZE` tokens."""
    planned = planned_config(MODEL, devices, sequences(seq_len), seq_len=seq_len)
    return dataclasses.replace(planned, moe=dataclasses.replace(planned.moe, group_size=GROUP_SIZE))


def searched(mapping: Mapping) -> bool:
    """Whether ``mapping``'s tensor degree and MoE layout are the recipe's (the layouts
    searched)."""
    return (
        mapping.tensor == TENSOR
        and mapping.expert == EXPERT_GROUP
        and mapping.expert_tensor == 1
        and mapping.dispatcher == "all_to_all"
    )


def rows(searches: Sequence[Search]) -> list[str]:
    """The table of the long-sequence searches: the best mapping that fits and its MFU."""
    lines = [
        "| tokens a sequence | devices | sequences a step | layouts | estimated | fit 80 GB | "
        "best proven | best mapping that fits | schedule | step ms | compute ms | exposed "
        "comm ms | MFU | GB/device |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for search in searches:
        head = (
            f"| {search.seq_len} | {search.devices} | {search.batch} | {search.layouts} | "
            f"{search.estimated} | {search.fitting} | "
            f"{'yes' if search.complete else 'no: stopped at the time limit'} |"
        )
        best = search.best
        if best is None:
            lines.append(f"{head} none fits |" + " |" * 6)
            continue
        t = best.best
        lines.append(
            f"{head} {best.mapping.label()} | `{best.schedule}` | {t.step * 1e3:.0f} | "
            f"{t.compute * 1e3:.0f} | {t.exposed_communication * 1e3:.0f} | {best.mfu:.1%} | "
            f"{best.peak_bytes / 1e9:.1f} |"
        )
    return lines
