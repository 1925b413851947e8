"""Do ``model.fp8``'s GEMMs become FP8 matrix products on an H100? The train step compiled
ahead of time for one H100 (no GPU needed), its GEMMs read back from the optimized HLO.

    python -m experiments.fp8_aot_check [--presets mixtral-tiny deepseek_v3-tiny]
        [--target h100_sxm] [--recipes none,tensorwise,blockwise] [--out FILE]

For each preset and recipe, the preset's train step (one device, ``model.dtype bfloat16``) is
compiled for the GPU the target description gives (:mod:`experiments.shared.gpu_devices`;
it needs XLA's CUDA plugin wheels of this JAX, ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` or their CUDA 13 pair, ``ptxas`` (``nvidia-cuda-nvcc-cu12``), and
``JAX_PLATFORMS=cpu``). Every ``dot`` of the optimized module
(inside XLA:GPU's GEMM fusions, and cuBLAS calls) is counted by its operands' element
types: with ``model.fp8`` the attention, dense and expert GEMMs of the forward pass and
both gradients take ``f8e4m3fn`` operands (the fused GEMM kernels on Hopper multiply
them on its FP8 tensor cores), and what stays in bfloat16 or float32 is the attention
core, the router and the output head. Writes ``experiments/results/fp8_aot_check.md``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
from pathlib import Path

from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results" / "fp8_aot_check.md"
# A computation's header, an instruction's definition, and a dot's operands.
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_PARAM = re.compile(r"([\w.\-]+): (\w+)\[")
_DEFINITION = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (\w+)\[")
_DOT = re.compile(r"= (\w+)\[[^\]]*\][^ ]* dot\(%([\w.\-]+), %([\w.\-]+)\)")
_CUBLAS = re.compile(r'custom_call_target="(__cublas[^"]*)"')


def dot_operand_types(hlo: str) -> collections.Counter:
    """``(lhs type, rhs type, result type)`` -> how many dots of the module have them,
    and ``("cublas", target, "")`` for each cuBLAS call."""
    found: collections.Counter = collections.Counter()
    types: dict[str, str] = {}
    for line in hlo.splitlines():
        line = line.strip()
        header = _HEADER.match(line)
        if header:
            types = dict(_PARAM.findall(header.group(2)))
            continue
        definition = _DEFINITION.match(line)
        if definition:
            types[definition.group(1)] = definition.group(2)
        dot = _DOT.search(line)
        if dot:
            result, lhs, rhs = dot.groups()
            found[(types.get(lhs, "?"), types.get(rhs, "?"), result)] += 1
        for target in _CUBLAS.findall(line):
            found[("cublas", target, "")] += 1
    return found


def compile_step(preset: str, recipe: str, device):
    """The optimized HLO of the preset's train step on ``device``, FP8 by ``recipe``."""
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.presets import preset as preset_config
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import scheduled_train_step

    config = preset_config(preset)
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, dtype="bfloat16", fp8=recipe),
        parallel=dataclasses.replace(config.parallel, data=1, expert=1),
    )
    mesh = build_mesh(config.parallel, [device])
    return scheduled_train_step(resolve(config, mesh)).compile().as_text()


def render(rows: dict[tuple[str, str], collections.Counter], args, argv, kind: str) -> str:
    lines = [
        "# FP8 GEMMs in the train step compiled for an H100",
        "",
        f"Command: `{command_line('experiments.fp8_aot_check', argv)}`",
        "",
        "One device, `model.dtype bfloat16`, compiled ahead of time for "
        f"{kind} from the target description `{args.target}` (no GPU attached; not "
        "run). Each row: the dots of the optimized module by their operands' and result's "
        "element types (a dot sits inside one of XLA:GPU's GEMM fusions or is a cuBLAS call).",
        "",
        "| preset | model.fp8 | lhs | rhs | result | dots |",
        "|---|---|---|---|---|---|",
    ]
    for (preset, recipe), counts in rows.items():
        for (lhs, rhs, result), count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"| `{preset}` | {recipe} | {lhs} | {rhs} | {result} | {count} |")
    lines.append("")
    for (preset, recipe), counts in rows.items():
        eight = sum(n for (lhs, rhs, _), n in counts.items() if lhs == rhs == "f8e4m3fn")
        total = sum(n for key, n in counts.items() if key[0] != "cublas")
        lines.append(f"- `{preset}`, {recipe}: {eight} of {total} dots take two f8e4m3fn operands.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["mixtral-tiny", "deepseek_v3-tiny"])
    parser.add_argument("--target", default="h100_sxm", help="a GPU model's description")
    parser.add_argument("--recipes", default="none,tensorwise,blockwise")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    from experiments.shared import gpu_devices

    target = gpu_devices.target_file(args.target)
    gpu_devices.configure()
    (device,) = gpu_devices.devices(aot=1, target=target)
    rows = {
        (preset, recipe): dot_operand_types(compile_step(preset, recipe, device))
        for preset in args.presets
        for recipe in args.recipes.split(",")
    }
    text = render(rows, args, argv, device.device_kind)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
