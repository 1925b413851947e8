"""Parallel folding at scale, in the simulator: published MoE shapes on 64-256 H100s.

For each model of :data:`experiments.folding_models.MODELS` and each device count, the
planner (``jaxmoe plan``) estimates every valid mapping on the H100 node profile, and
the best folded mapping is set against the best mapping whose MoE reuses attention's
layout (:func:`~experiments.folding_models.reuses_attention_layout`): step time, MFU
and memory per device, among the mappings that fit the device's memory and among all
of them. Deep models are estimated from shallow traces
(:mod:`jaxmoe.plan.layer_extrapolation`).

    python -m experiments.folding_scale [--models M,...] [--devices 64,128,256]
        [--schedules none] [--recompute attention] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import scheduling
from experiments.folding_models import (
    MODELS,
    SEQ_LEN,
    SEQUENCES_PER_DEVICE,
    FoldingComparison,
    compare_folding,
    comparison_table,
    planned_config,
    reuses_attention_layout,
)
from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results"
PROFILE = "h100-8x-nvlink-3200g"
# The planner's search stops once this many mappings fit: more than there are.
EVERY_MAPPING = 10**6

LEFT_OUT = [
    "The options that trade time for memory: every mapping here runs with the preset's "
    "(no ZeRO, one microbatch, no pipeline, the recomputation named in the command), so "
    "that the comparison is of layouts alone. jaxmoe has the distributed optimizer and "
    "fully sharded parameters (train.zero 1 and 3), gradient accumulation "
    "(train.microbatches), pipelines (parallel.pipeline, virtual stages) and full-layer "
    "recomputation; the planner searches them (jaxmoe plan, experiments/scale_eval.py), "
    "not this comparison.",
    "Context parallelism: jaxmoe has none; Megatron-Core's long-sequence runs split "
    "attention's sequence over devices.",
    "Gradient accumulation: a step here is one micro-batch round (one sequence per "
    "device) and synchronises gradients each time; with a global batch of many rounds "
    "the synchronisation is paid once per step.",
    "Fused kernels: the cost model charges every elementwise op its full memory traffic "
    "(nothing fused), and attention is the plain softmax(QK^T)V of jaxmoe's model, with "
    "its [heads, seq, seq] weights, not a fused flash attention; both lower the MFU "
    "against Megatron-Core's (TransformerEngine, grouped GEMMs).",
    "Load imbalance: routing is costed at the capacity buffers (capacity factor 1.0), "
    "the same for every mapping.",
]


def plan_model(model: str, devices: int, schedules: Sequence[str], model_fields: dict):
    from jaxmoe.plan.estimates import default_cache_dir
    from jaxmoe.plan.planner import plan_mappings

    config = planned_config(model, devices, **model_fields)
    started = time.perf_counter()
    # Every layout estimated, at the preset's options (see LEFT_OUT), those over the
    # device's memory too: the planner is told of no limit (it would leave them out
    # untraced), and what fits is judged here against the profile's memory.
    result = plan_mappings(
        config,
        model,
        devices,
        PROFILE,
        schedules,
        cache_dir=default_cache_dir(),
        top=EVERY_MAPPING,
        options=False,
        pipeline=False,
        cross_node_tensor=True,
        memory_capacity_bytes=0,
    )
    device = scheduling.PROFILES[PROFILE]
    capacity = device.memory_capacity_bytes
    estimates = sorted(
        (dataclasses.replace(e, fits=e.memory.total <= capacity) for e in result.estimates),
        key=lambda e: (not e.fits, -e.mfu, e.memory.total),
    )
    result = dataclasses.replace(result, profile=device, estimates=estimates)
    seconds = time.perf_counter() - started
    print(f"{model} on {devices}: {len(result.estimates)} mappings, {seconds:.0f} s", flush=True)
    return result, seconds


def speedup_lines(comparisons: Sequence[FoldingComparison]) -> list[str]:
    lines = []
    for c in comparisons:
        if c.speedup is None:
            lines.append(f"- {c.model} on {c.devices}: no comparison (one side has no mapping)")
            continue
        lines.append(
            f"- {c.model} on {c.devices}: best folded step {c.speedup:.3f}x faster than best "
            f"reused (MFU {c.best_folded.mfu:.1%} against {c.best_reused.mfu:.1%})"
        )
    return lines


def report(rows: list[dict], command: str, schedules: Sequence[str], fields: dict) -> str:
    fitting = [row["fitting"] for row in rows]
    unconstrained = [row["all"] for row in rows]
    lines = [
        "# Parallel folding at scale, in the simulator: published MoE shapes on H100s",
        "",
        f"    {command}",
        "",
        f"Profile `{PROFILE}` (8 H100s per node over NVLink, 400 Gbit/s per GPU between "
        f"nodes; 80 GB per device). Sequence length {SEQ_LEN}, {SEQUENCES_PER_DEVICE} "
        "sequence per device per step, bfloat16 activations, capacity factor 1.0, "
        f"schedules {', '.join(schedules)} (the fastest counts), "
        + (", ".join(f"model.{k}={v}" for k, v in fields.items()) or "no model overrides")
        + ". Every valid mapping is estimated: attention data x tensor, MoE expert data x "
        "expert x expert tensor, both dispatchers. A *reused* mapping's MoE takes "
        "attention's layout (expert tensor = tensor, the expert group inside attention's "
        "data axis: Megatron-Core without folding); every other valid mapping is *folded*.",
        "",
        "Least memory per device over all mappings, and over the reused ones (GB). Planner "
        "seconds are this run's: estimates already in the planner's cache are read, not "
        "traced again.",
        "",
        "| model | devices | mappings | fit in 80 GB | least GB/device | least reused "
        "| planner seconds |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {row['model']} | {row['devices']} | {row['mappings']} | {row['fits']} | "
            f"{row['least_memory'] / 1e9:.1f} | {row['least_reused_memory'] / 1e9:.1f} | "
            f"{row['seconds']:.0f} |"
            for row in rows
        ),
        "",
        *(
            f"- {row['model']} on {row['devices']}: activations are "
            f"{row['least_memory_activations'] / 1e9:.1f} of the least-memory mapping's "
            f"{row['least_memory'] / 1e9:.1f} GB (tokens per device do not fall with more "
            "devices: one sequence each)"
            for row in rows
        ),
        "",
        "## Among the mappings that fit in device memory",
        "",
        *comparison_table(fitting),
        "",
        *speedup_lines(fitting),
        "",
        "## Among all mappings, memory aside",
        "",
        *comparison_table(unconstrained),
        "",
        *speedup_lines(unconstrained),
        "",
        "## What the simulator leaves out",
        "",
        *(f"- {line}" for line in LEFT_OUT),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--devices", default="64,128,256")
    parser.add_argument("--schedules", default="none")
    parser.add_argument("--recompute", default=None, help="model.recompute for every model")
    parser.add_argument("--out", type=Path, default=RESULTS / "folding_scale.md")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    device_counts = [int(n) for n in args.devices.split(",")]
    schedules = [s for s in args.schedules.split(",") if s]
    fields = {} if args.recompute is None else {"recompute": args.recompute}
    for model in models:  # every input checked before the first trace
        for devices in device_counts:
            planned_config(model, devices, **fields)
    if not args.out.parent.is_dir():
        parser.error(f"--out: {args.out.parent} is not a directory")
    command = command_line("experiments.folding_scale", sys.argv[1:] if argv is None else argv)
    rows = []
    for model in models:
        for devices in device_counts:
            result, seconds = plan_model(model, devices, schedules, fields)
            least = min(result.estimates, key=lambda e: e.memory.total)
            rows.append(
                {
                    "model": model,
                    "devices": devices,
                    "mappings": len(result.estimates),
                    "fits": len(result.ranked),
                    "seconds": seconds,
                    "least_memory": least.memory.total,
                    "least_memory_activations": least.memory.activations,
                    "least_reused_memory": min(
                        e.memory.total
                        for e in result.estimates
                        if reuses_attention_layout(e.mapping)
                    ),
                    "fitting": compare_folding(model, result.ranked, devices),
                    "all": compare_folding(
                        model, sorted(result.estimates, key=lambda e: -e.mfu), devices
                    ),
                }
            )
            args.out.write_text(report(rows, command, schedules, fields))


if __name__ == "__main__":
    main()
