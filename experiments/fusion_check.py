"""Does the cost model fuse what XLA:GPU fuses? Bytes per kernel class, the model's
against the module XLA compiles for an H100.

    python -m experiments.fusion_check [--target h100_sxm] [--layers 2] [--d-model 1024]
        [--seq 2048] [--out experiments/results/fusion_check.md]

The per-device train step of a Mixtral-shaped model on 2 data-parallel GPUs (bfloat16,
the blockwise attention core in both, schedule ``none``) is

- captured and priced by the cost model on the H100 profile, bound to the program (its
  kernels: :mod:`scheduling.costs.fusion`), and, beside it, op by op (no fusion);
- compiled ahead of time for two H100s of one node from their target description (XLA's GPU plugin
  for this JAX, no GPU: :mod:`experiments.shared.gpu_devices`), and its optimized HLO's
  kernels read back with their bytes (:mod:`experiments.shared.hlo_kernels`).

It needs XLA's GPU plugin for this JAX beside it (``pip install jax-cuda13-plugin==V
jax-cuda13-pjrt==V`` for jax V, no CUDA libraries: compiling needs only ``ptxas`` on the
path), and no GPU. The attention core runs blockwise on both sides, so the profile's
one-kernel pricing (cuDNN's flash attention) is off here: the comparison is of XLA's
fusion of the same ops. Classes: matmul, reduction, elementwise (everything else that
moves memory). XLA's ``compiled.cost_analysis()`` is empty for a module compiled without
a device, so XLA's side is its kernels' operands and results, as its cost analysis
counts them (and an operand only gathered from, by the rows gathered).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results" / "fusion_check.md"
PROFILE = "h100-8x-nvlink-3200g"
CLASSES = ("matmul", "reduction", "elementwise")


def _config(args: argparse.Namespace) -> Any:
    from jaxmoe.presets import preset

    config = preset("mixtral-8x7b")
    heads = args.d_model // 128
    return dataclasses.replace(
        config,
        model=dataclasses.replace(
            config.model,
            d_model=args.d_model,
            num_heads=heads,
            num_kv_heads=max(1, heads // 4),
            num_layers=args.layers,
            d_ff=args.d_model * 7 // 2,
            seq_len=args.seq,
            attention="blockwise",
        ),
        parallel=dataclasses.replace(config.parallel, data=args.devices, expert=1),
        train=dataclasses.replace(config.train, batch_size=args.devices, microbatches=1),
        schedule=dataclasses.replace(config.schedule, name="none", profile=PROFILE),
    )


def _class(op: Any) -> str:
    import scheduling

    if scheduling.is_matmul(op):
        return "matmul"
    return "reduction" if op.primitive in scheduling.REDUCTIONS else "elementwise"


def model_kernels(program: Any, cost: Any) -> dict[str, dict[str, float]]:
    """Launches and bytes per class, as ``cost`` prices ``program`` (loops' bodies times
    their trips). A kernel is classed as XLA's fusions are: a matmul's, else a reduction
    where one of its ops reduces (a multi-output kernel of an elementwise pass and a
    reduction over the same buffer is a reduction's), else elementwise."""
    kernels: dict[tuple[int, int], dict[str, Any]] = {}  # (body, kernel) -> its ops' figures

    def visit(model: Any, op: Any, repeats: float) -> None:
        if op.is_collective:
            return
        bodies = model.bodies(op)
        if bodies:
            for ops, times, inner in bodies:
                for body_op in ops:
                    visit(inner, body_op, repeats * times)
            return
        moved = model.bytes_moved(op)
        if not moved:
            return
        fusion = model.fusion
        kernel = fusion.kernel(op) if fusion is not None and fusion.knows(op) else None
        key = (id(fusion), id(op) if kernel is None else kernel)
        entry = kernels.setdefault(key, {"classes": set(), "bytes": 0.0, "kernels": 0.0})
        entry["classes"].add(_class(op))
        entry["bytes"] += moved * repeats
        entry["kernels"] += repeats if model.launches(op) else 0.0

    for op in program.ops:
        visit(cost, op, 1.0)
    table = {name: {"kernels": 0.0, "bytes": 0.0} for name in CLASSES}
    for entry in kernels.values():
        name = next(name for name in CLASSES if name in entry["classes"])
        table[name]["bytes"] += entry["bytes"]
        table[name]["kernels"] += entry["kernels"]
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h100_sxm", help="a GPU model's description")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--devices", type=int, default=2, help="data-parallel GPUs")
    parser.add_argument("--out", type=Path, default=RESULTS, help="markdown; a .json beside")
    parser.add_argument("--hlo", type=Path, default=None, help="keep the optimized HLO here")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX itself off the missing driver
    from jaxmoe.parallel.host_devices import ensure_xla_flags

    # As many CPU devices as GPUs, to capture the same per-device program.
    ensure_xla_flags([f"--xla_force_host_platform_device_count={args.devices}"])

    import jax

    import scheduling
    from experiments.shared import gpu_devices, hlo_kernels
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step

    try:
        target = gpu_devices.target_file(args.target)
        devices = gpu_devices.devices(aot=args.devices, target=target)
    except Exception as error:  # no GPU plugin for this JAX
        print(f"fusion_check: cannot compile for a GPU here ({error})", file=sys.stderr)
        return 2
    config = _config(args)
    mesh = build_mesh(config.parallel, devices)
    run = resolve(config, mesh)
    began = time.perf_counter()
    compiled = scheduled_train_step(run).compile()
    compile_s = time.perf_counter() - began
    hlo = compiled.as_text()
    xla = hlo_kernels.by_kind(hlo_kernels.kernels(hlo))

    cpus = jax.devices("cpu")[: args.devices]
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel, cpus)))
    # The same ops as XLA compiles them: the blockwise core as ops, not as cuDNN's kernel.
    profile = dataclasses.replace(scheduling.PROFILES[PROFILE], fused_kernels=False)
    base = scheduling.CostModel(profile, dict(program.mesh.shape))
    fused = model_kernels(program, base.bound_to(program))
    alone = model_kernels(program, base)

    rows = []
    for name in CLASSES:
        theirs = xla.get(name, {"kernels": 0.0, "bytes": 0.0})
        rows.append(
            {
                "class": name,
                "xla_kernels": theirs["kernels"],
                "xla_gb": theirs["bytes"] / 1e9,
                "model_kernels": fused[name]["kernels"],
                "model_gb": fused[name]["bytes"] / 1e9,
                "op_by_op_gb": alone[name]["bytes"] / 1e9,
            }
        )
    totals = {
        key: sum(row[key] for row in rows)
        for key in ("xla_kernels", "xla_gb", "model_kernels", "model_gb", "op_by_op_gb")
    }
    other = {k: v for k, v in xla.items() if k not in CLASSES}
    command = command_line("experiments.fusion_check", sys.argv[1:] if argv is None else argv)
    model = config.model
    lines = [
        "# The cost model's fusion against XLA:GPU's, per kernel class",
        "",
        f"    {command}",
        "",
        f"The per-device train step on {args.devices} data-parallel GPUs: "
        f"{model.num_layers} Mixtral-shaped layers (d_model "
        f"{model.d_model}, {model.num_heads} heads of 128, {model.num_kv_heads} KV heads, d_ff "
        f"{model.d_ff}, 8 experts top-2), one sequence of {model.seq_len} tokens per GPU, "
        "bfloat16, the blockwise attention core. XLA: the module compiled ahead of time for "
        f"{args.devices} x {devices[0].device_kind} (`{args.target}`, no GPU attached; compiled in "
        f"{compile_s:.0f} s), its kernels' operands and results read from the optimized "
        "HLO (an operand a kernel only slices or gathers from: the part it reads; "
        "experiments/shared/hlo_kernels.py). Model: the cost model on the H100 profile "
        "bound to the captured program (scheduling/costs/fusion.py), each of its kernels "
        "classed as XLA's fusions are (a kernel with a reduction among its ops is a "
        "reduction's), and op by op (no fusion) beside it. Loops count their trips.",
        "",
        "| class | XLA kernels | XLA GB | model kernels | model GB | model / XLA | op by op GB |",
        "|---|---|---|---|---|---|---|",
    ]
    fused_rows = [row for row in rows if row["class"] != "matmul"]
    besides = {
        key: sum(row[key] for row in fused_rows)
        for key in ("xla_kernels", "xla_gb", "model_kernels", "model_gb", "op_by_op_gb")
    }
    for row in [*rows, {"class": "reduction + elementwise", **besides}, {"class": "all", **totals}]:
        ratio = row["model_gb"] / row["xla_gb"] if row["xla_gb"] else float("nan")
        lines.append(
            f"| {row['class']} | {row['xla_kernels']:.0f} | {row['xla_gb']:.3f} | "
            f"{row['model_kernels']:.0f} | {row['model_gb']:.3f} | {ratio:.2f} | "
            f"{row['op_by_op_gb']:.3f} |"
        )
    if other:
        lines += ["", f"XLA kernels of other classes: {json.dumps(other)}"]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if args.hlo:
        args.hlo.write_text(hlo)
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "compile_s": compile_s, "rows": rows}, indent=2) + "\n"
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
