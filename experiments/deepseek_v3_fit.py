"""DeepSeek-V3 in the planner: Megatron-Core's published throughput beside the planner's
best mapping on the same GPUs, at the same global batch, in FP8.

Megatron-Core's figures are Megatron-Bridge's performance summary (NVIDIA-NeMo/
Megatron-Bridge, ``docs/performance-summary-archive.md``): DeepSeek-V3 pretraining,
sequences of 4096 tokens, micro-batches of one sequence, token-dropless with the tokens
forced to balance over the experts, with DeepSeek-V3's one MTP module (Megatron-Bridge's
DeepSeek-V3 pretraining configuration sets ``mtp_num_layers`` 1); model TFLOP/s per GPU
as Megatron counts them (MLA and MTP included, as
:func:`jaxmoe.plan.model_flops.model_flops` counts them).

Each search runs :func:`jaxmoe.plan.planner.plan_mappings` on the published system's
profile and device count, at its global batch, with ``model.fp8 tensorwise``: one scale
per tensor, the cost of Megatron's current-scaling FP8 and of MXFP8 on a B200, whose
tensor cores apply the 32-element block scales inside the product (jaxmoe's blockwise
recipe is DeepSeek's 128-wide tiles, accumulated slice by slice). Capacity factor 1.0
stands for the forced balance: every expert receives exactly its share.

The mappings estimated are few, each of them an estimate of about ten minutes here (the
trace of 16 microbatches, and the schedules' dW packing on it): for each published run,
Megatron's tensor and expert-parallel degrees, and where those differ from it, one
expert a device (:attr:`Published.layouts`); whole experts (expert tensor degree 1), the
all-to-all dispatcher (top-8 of 256 experts: an all-gather dispatcher would move every
token to every device), no pipeline. A pipelined DeepSeek-V3 is traced whole (its three
leading dense layers make the first chunk unlike the others, so the shallow traces'
extrapolation does not apply): 61 layers in ``microbatches x virtual`` ticks, hours a
mapping here. So Megatron's own mappings, pipelines included, are not estimated.

The options are fixed (:data:`OPTIONS`), not searched. Micro-batches of one sequence, as
Megatron's. ZeRO-3: without a pipeline each device holds the layers every data replica
repeats (attention, the dense layers, the shared experts: about 20 billion parameters),
and the planner's bounds for 16 microbatches with full recomputation on 256 B200s are
589 GB a device under ZeRO-1 and 293 GB without ZeRO, against 180. Full-layer
recomputation: three microbatches are in flight
(:data:`scheduling.names.MICROBATCHES_IN_FLIGHT`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from experiments.folding_models import SEQ_LEN
from jaxmoe.config import Config
from jaxmoe.presets import preset

if TYPE_CHECKING:
    from experiments.scale_eval import Search
    from jaxmoe.plan.mappings import Mapping

MODEL = "deepseek_v3-671b"
# The FP8 recipe of the searches (module docstring).
FP8 = "tensorwise"
SOURCE = (
    "Megatron-Bridge's performance summary (github.com/NVIDIA-NeMo/Megatron-Bridge, "
    "docs/performance-summary-archive.md)"
)


@dataclass(frozen=True)
class Published:
    """One of Megatron-Core's measured DeepSeek-V3 runs."""

    system: str  # as the summary names it
    profile: str  # jaxmoe's profile of that system
    devices: int
    precision: str
    global_batch: int  # sequences a step
    mapping: str  # Megatron's parallel sizes
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    release: str  # the NeMo container the figure was measured with
    # The (tensor, expert) degrees of the mappings estimated beside it (module docstring).
    layouts: tuple[tuple[int, int], ...] = ()


PUBLISHED = (
    Published(
        "DGX-B200", "b200-8x-nvlink-3200g", 256, "MXFP8", 4096,
        "TP1 PP8 VP2 EP32 CP1, recompute MLA up-projection and MLP",
        3328, 864, "26.04.01", ((1, 32), (1, 256)),
    ),
    Published(
        "DGX-H100", "h100-8x-nvlink-3200g", 1024,
        "FP8 (330 TFLOP/s with DeepSeek's 128x128 and 1x128 blocks)", 8192,
        "TP2 PP8 VP4 EP64 CP1", 1297, 338, "25.09", ((2, 64),),
    ),
)  # fmt: skip


def published(profile: str, devices: int) -> Published:
    """The published run on ``devices`` devices of ``profile``."""
    for run in PUBLISHED:
        if (run.profile, run.devices) == (profile, devices):
            return run
    raise KeyError(f"no published DeepSeek-V3 run on {devices} devices of {profile}")


# The options of every mapping searched (module docstring); microbatches: one sequence
# each.
OPTIONS = {"zero": 3, "recompute": "layer"}


def config(batch: int, devices: int) -> Config:
    """DeepSeek-V3 (the ``deepseek_v3-671b`` preset, its published architecture with its
    MTP module) at ``batch`` sequences of :data:`SEQ_LEN` a step on ``devices`` devices,
    in FP8, with :data:`OPTIONS` and a microbatch per sequence of a device."""
    model = preset(MODEL)
    if model.model.seq_len != SEQ_LEN:
        raise ValueError(f"{MODEL}: sequences of {model.model.seq_len}, not {SEQ_LEN}")
    if batch % devices:
        raise ValueError(f"{batch} sequences do not split over {devices} devices")
    return dataclasses.replace(
        model,
        model=dataclasses.replace(model.model, fp8=FP8, recompute=OPTIONS["recompute"]),
        train=dataclasses.replace(
            model.train, batch_size=batch, zero=OPTIONS["zero"], microbatches=batch // devices
        ),
    )


def searched(run: Published) -> Callable[[Mapping], bool]:
    """Whether a mapping is one of those estimated beside ``run`` (module docstring)."""

    def layout(mapping: Mapping) -> bool:
        return (
            (mapping.tensor, mapping.expert) in run.layouts
            and mapping.expert_tensor == 1
            and mapping.dispatcher == "all_to_all"
            and mapping.pipeline == 1
            and mapping.context == 1
        )

    return layout


def rows(searches: Sequence[Search]) -> list[str]:
    """Each published run beside the planner's best mapping on its system."""
    import scheduling

    lines = [
        "| system | devices | sequences a step | precision | mapping | tokens/s per GPU | "
        "TFLOP/s per GPU | MFU (16-bit peak) | step s | exposed comm s | GB/device | "
        "estimated (fit) | best proven |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for search in searches:
        run = published(search.profile, search.devices)
        lines.append(
            f"| {run.system} | {run.devices} | {run.global_batch} | {run.precision} | "
            f"Megatron-Core ({run.release}): {run.mapping} | {run.tokens_per_s_per_gpu:.0f} | "
            f"{run.tflops_per_gpu:.0f} | | | | | | |"
        )
        head = f"| {run.system} (simulated) | {search.devices} | {search.batch} | FP8 {FP8} |"
        best = search.best
        if best is None:
            lines.append(f"{head} jaxmoe: none fits |" + " |" * 8)
            continue
        t = best.best
        tokens = _tokens_per_s_per_gpu(search)
        # The planner's MFU is over the model dtype's (bfloat16) peak of the profile.
        tflops = best.mfu * scheduling.PROFILES[search.profile].peak_flops_per_s("bfloat16")
        lines.append(
            f"{head} jaxmoe: {best.mapping.label()}, `{best.schedule}` | {tokens:.0f} | "
            f"{tflops / 1e12:.0f} | {best.mfu:.1%} | {t.step:.2f} | "
            f"{t.exposed_communication:.2f} | {best.peak_bytes / 1e9:.1f} | "
            f"{search.estimated} ({search.fitting}) | "
            f"{'yes' if search.complete else 'no: stopped at the time limit'} |"
        )
    return [*lines, "", *gap_lines(searches)]


def gap_lines(searches: Sequence[Search]) -> list[str]:
    """For each estimate, what its step is made of against the published figure."""
    lines = []
    for search in searches:
        run, best = published(search.profile, search.devices), search.best
        if best is None:
            continue
        t = best.best
        tokens = _tokens_per_s_per_gpu(search)
        lines.append(
            f"- {run.system} on {run.devices}: {tokens:.0f} tokens/s per GPU against "
            f"{run.tokens_per_s_per_gpu:.0f} published ({run.tokens_per_s_per_gpu / tokens:.1f}x); "
            f"its computation takes {t.compute:.1f} s of the {t.step:.1f} s step, "
            f"{t.exposed_communication:.1f} s are exposed communication (of "
            f"{t.communication:.1f} s). Without a pipeline, ZeRO-3 gathers the parameters "
            "every data replica repeats (attention, the dense layers, the shared experts) "
            "and reduce-scatters their gradients in every microbatch's passes; a pipeline "
            "keeps each stage's layers resident."
        )
    return lines


def _tokens_per_s_per_gpu(search: Search) -> float:
    """The tokens a device trains per second at the search's best step."""
    assert search.best is not None
    return search.batch * search.seq_len / search.best.best.step / search.devices
