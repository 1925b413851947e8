"""How long XLA:GPU takes to compile the full-depth per-device step of a published model,
ahead of time for H100s, on a host with no GPU.

    python -m experiments.compile_depth_gpu [--preset mixtral-8x22b] [--layers 4,56]
        [--devices 64] [--data 2] [--expert 8] [--expert-tensor 4] [--tensor 1]
        [--target h100_sxm] [--out FILE]

The preset's model at its published width (bfloat16, sequences of its length, one per
device, the flash attention core traced blockwise: cuDNN's cannot be traced without a
GPU) on ``--devices`` H100s of the given layout (by default the planner's best for
Mixtral 8x22B on 64 H100s: attention 64 x 1, MoE 2 x 8 x 4, ZeRO-1 and full-layer
recomputation), compiled for a topology of that many GPUs described by ``--target``
(XLA's GPU plugin for this JAX and ``ptxas`` on the path, no GPU:
:mod:`experiments.shared.gpu_devices`). For each depth: the CPU seconds (this process's and
ptxas's) and wall seconds to trace and lower the step (schedule ``none``), then to
compile it. The layers are unrolled.
Writes ``experiments/results/compile_depth_gpu.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results" / "compile_depth_gpu.md"


def _cpu() -> float:
    """CPU seconds of this process and of the processes it waited for (ptxas)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _timed(fn):
    cpu, wall = _cpu(), time.perf_counter()
    result = fn()
    return result, _cpu() - cpu, time.perf_counter() - wall


def measure(args: argparse.Namespace, devices, layers: int) -> dict:
    from jaxmoe.config import ParallelConfig
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.presets import preset
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import scheduled_train_step

    config = preset(args.preset)
    parallel = ParallelConfig(
        data=args.data, expert=args.expert, expert_tensor=args.expert_tensor, tensor=args.tensor
    )
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(
            config.model, num_layers=layers, attention="blockwise", recompute=args.recompute
        ),
        parallel=parallel,
        train=dataclasses.replace(
            config.train, batch_size=len(devices), microbatches=1, zero=args.zero
        ),
        schedule=dataclasses.replace(config.schedule, name="none"),
    )
    mesh = build_mesh(config.parallel, devices)
    run = resolve(config, mesh)
    step = scheduled_train_step(run)
    lowered, trace_cpu, trace_wall = _timed(lambda: step.step.lower(*step.example))
    _, compile_cpu, compile_wall = _timed(lowered.compile)
    return {
        "layers": layers,
        "trace_cpu_s": trace_cpu,
        "trace_wall_s": trace_wall,
        "compile_cpu_s": compile_cpu,
        "compile_wall_s": compile_wall,
    }


def render(rows: list[dict], args: argparse.Namespace, argv: list[str], kind: str) -> str:
    lines = [
        "# Compiling the full-depth step for H100s, ahead of time",
        "",
        f"Command: `{command_line('experiments.compile_depth_gpu', argv)}`",
        "",
        f"`{args.preset}` at its published width, bfloat16, one sequence per GPU, the flash "
        f"core traced blockwise, on {args.devices} x {kind} (`{args.target}`, compiled ahead "
        "of time on a 2-core host with no GPU): attention "
        f"{args.devices // args.tensor} x {args.tensor}, MoE "
        f"{args.devices // (args.expert * args.expert_tensor)} x {args.expert} x "
        f"{args.expert_tensor}, ZeRO-{args.zero}, recompute {args.recompute}, schedule "
        "`none`. One measurement each.",
        "",
        "| layers | trace and lower: CPU s (wall s) | compile: CPU s (wall s) |",
        "|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['layers']} | {row['trace_cpu_s']:.0f} ({row['trace_wall_s']:.0f}) | "
            f"{row['compile_cpu_s']:.0f} ({row['compile_wall_s']:.0f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mixtral-8x22b")
    parser.add_argument("--layers", default="4,56")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--expert", type=int, default=8)
    parser.add_argument("--expert-tensor", type=int, default=4)
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--recompute", default="layer")
    parser.add_argument("--target", default="h100_sxm")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX itself off the missing driver
    from experiments.shared import gpu_devices

    target = gpu_devices.target_file(args.target)
    devices = gpu_devices.devices(aot=args.devices, target=target)
    rows = []
    for layers in (int(n) for n in args.layers.split(",")):
        rows.append(measure(args, devices, layers))
        print(rows[-1], flush=True)
        args.out.write_text(render(rows, args, argv, devices[0].device_kind))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
