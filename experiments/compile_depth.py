"""How long the whole-step program takes to build at a model's full depth: trace, schedule
and compile time against the number of layers, on this host.

    python -m experiments.compile_depth [--preset mixtral-8x22b] [--layers 4,14,28,56]
        [--schedules none,lancet] [--d-model 64] [--seq-len 64] [--out FILE]

The preset's blocks (Mixtral 8x22B: 56 layers of grouped-query attention and 8 SwiGLU
experts) at a small width on the 8 fake CPU devices of a test host (data 1, expert 8),
so that the time is the program's size, not its arithmetic: for each depth and schedule,
the CPU seconds of this process to trace the step and, for a schedule other than
``none``, to capture and reorder it (``scheduled_train_step``), then to compile it
(XLA:CPU, the backend's optimisation at the suite's level 0 unless ``--llvm-opt``). The
layers are unrolled in the traced step (no scan), so every figure grows with the depth:
the slope per layer and the figure at full depth say whether the depth needs a scan.
Writes ``experiments/results/compile_depth.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results" / "compile_depth.md"


def _timed(fn):
    """``(result, CPU seconds of this process, wall seconds)`` of ``fn()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def measure(preset_name: str, layers: int, schedule: str, d_model: int, seq_len: int) -> dict:
    """Trace (and schedule) then compile one step of ``preset_name`` cut to ``layers``."""
    from jaxmoe.config import ParallelConfig, TrainConfig
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.presets import preset
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import scheduled_train_step

    config = preset(preset_name)
    heads, kv_heads = 4, min(config.model.kv_heads, 2)
    model = dataclasses.replace(
        config.model,
        num_layers=layers,
        d_model=d_model,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=None,
        d_ff=2 * d_model,
        seq_len=seq_len,
        vocab_size=256,
        dtype="float32",
    )
    moe = dataclasses.replace(config.moe, d_expert=None)
    config = dataclasses.replace(
        config,
        model=model,
        moe=moe,
        parallel=ParallelConfig(data=1, expert=8),
        train=TrainConfig(batch_size=8, warmup_steps=1),
        schedule=dataclasses.replace(config.schedule, name=schedule),
    )
    mesh = build_mesh(config.parallel)
    run = resolve(config, mesh)
    step, trace_cpu, trace_wall = _timed(lambda: scheduled_train_step(run))
    if step.report is None:  # the plain jit traces when it is lowered
        lowered, lower_cpu, lower_wall = _timed(lambda: step.step.lower(*step.example))
        trace_cpu, trace_wall = trace_cpu + lower_cpu, trace_wall + lower_wall
        _, compile_cpu, compile_wall = _timed(lowered.compile)
    else:  # emitted, lowered and compiled in one call
        _, compile_cpu, compile_wall = _timed(step.compile)
    return {
        "layers": layers,
        "schedule": schedule,
        "trace_cpu_s": trace_cpu,
        "trace_wall_s": trace_wall,
        "compile_cpu_s": compile_cpu,
        "compile_wall_s": compile_wall,
    }


def _slope(rows: list[dict], key: str) -> float:
    """Seconds per layer between the shallowest and the deepest row."""
    first, last = rows[0], rows[-1]
    return (last[key] - first[key]) / max(1, last["layers"] - first["layers"])


def render(rows: list[dict], args: argparse.Namespace, argv: list[str]) -> str:
    import jax

    lines = [
        "# Building the whole-step program at full depth",
        "",
        f"Command: `{command_line('experiments.compile_depth', argv)}`",
        "",
        f"`{args.preset}`'s blocks at d_model {args.d_model}, {args.seq_len} tokens a row, "
        f"float32, on {len(jax.devices())} fake {jax.devices()[0].platform} devices (data 1 x "
        f"expert 8), jax {jax.__version__}, {platform.processor() or platform.machine()}, "
        f"XLA flags `{os.environ.get('XLA_FLAGS', '')}`. CPU seconds of this process, one "
        "measurement each (no repeats: read the rows against each other, not as exact).",
        "",
        "| schedule | layers | trace (+ schedule) s | (emit, lower and) compile s | total s |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        total = row["trace_cpu_s"] + row["compile_cpu_s"]
        lines.append(
            f"| {row['schedule']} | {row['layers']} | {row['trace_cpu_s']:.1f} | "
            f"{row['compile_cpu_s']:.1f} | {total:.1f} |"
        )
    lines += ["", "Per layer (slope from the shallowest to the deepest):", ""]
    for schedule in dict.fromkeys(row["schedule"] for row in rows):
        mine = [row for row in rows if row["schedule"] == schedule]
        lines.append(
            f"- {schedule}: trace {_slope(mine, 'trace_cpu_s'):.2f} s, compile "
            f"{_slope(mine, 'compile_cpu_s'):.2f} s a layer"
        )
    deepest = max(row["layers"] for row in rows)
    totals = {
        row["schedule"]: row["trace_cpu_s"] + row["compile_cpu_s"]
        for row in rows
        if row["layers"] == deepest
    }
    summary = ", ".join(f"{seconds:.0f} s ({name})" for name, seconds in totals.items())
    lines += ["", f"At {deepest} layers the whole step builds in {summary} of CPU time."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mixtral-8x22b")
    parser.add_argument("--layers", default="4,14,28,56")
    parser.add_argument("--schedules", default="none,lancet")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--llvm-opt", action="store_true", help="XLA:CPU's default backend")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    flags = ["--xla_force_host_platform_device_count=8"]
    if not args.llvm_opt:
        flags.append("--xla_backend_optimization_level=0")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    rows = []
    for schedule in args.schedules.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            row = measure(args.preset, layers, schedule, args.d_model, args.seq_len)
            print(row, flush=True)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(rows, args, argv))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
