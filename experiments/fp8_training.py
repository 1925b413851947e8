"""FP8 training against bfloat16: ``model.fp8`` tensorwise and blockwise against none, the
same data, seed and steps, on ``mixtral-tiny`` (padded expert slots: the batched GEMMs)
and ``deepseek_v3-tiny`` (ragged dropless dispatch: the grouped GEMM; latent attention,
MTP), all in ``model.dtype bfloat16``.

    python -m experiments.fp8_training [--steps 200] [--presets mixtral-tiny deepseek_v3-tiny]
        [--out FILE]

Each run is ``jaxmoe train`` on the 8 fake CPU devices of this host (data 4 x expert 2);
the table gives, per preset and recipe, the first loss, the mean loss of the last tenth
of the steps and its spread, the final loss, and the relative difference of the last
tenth's mean from bfloat16's (the issue's bound: 2%). Writes
``experiments/results/fp8_training.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results" / "fp8_training.md"
RECIPES = ("none", "tensorwise", "blockwise")
# Per preset: the flags that choose its expert path.
PRESETS = {
    "mixtral-tiny": [],
    "deepseek_v3-tiny": ["--moe.capacity_factor", "none", "--moe.dropless_dispatch", "ragged"],
}
BOUND = 0.02


def train(out: Path, preset: str, steps: int, recipe: str) -> list[float]:
    """The training losses of one run."""
    from jaxmoe.cli.main import main as jaxmoe

    argv = ["train", "--preset", preset, "--steps", str(steps), "--out", str(out)]
    argv += ["--model.dtype", "bfloat16", "--model.fp8", recipe, *PRESETS[preset]]
    argv += ["--parallel.data", "4", "--parallel.expert", "2", "--train.eval_every", str(steps)]
    if jaxmoe(argv) != 0:
        raise RuntimeError(f"jaxmoe {' '.join(argv)} failed")
    rows = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["loss"] for row in rows]


def summary(losses: list[float]) -> dict[str, float]:
    tail = losses[-max(2, len(losses) // 10) :]
    return {
        "first": losses[0],
        "tail_mean": statistics.fmean(tail),
        "tail_stdev": statistics.stdev(tail),
        "final": losses[-1],
    }


def render(results: dict[str, dict[str, list[float]]], steps: int, argv: list[str]) -> str:
    lines = [
        "# FP8 training against bfloat16",
        "",
        f"Command: `{command_line('experiments.fp8_training', argv)}`",
        "",
        f"{steps} steps on 8 fake CPU devices (data 4 x expert 2), `model.dtype bfloat16`, "
        "the same data and seed; `model.fp8` none (bfloat16 GEMMs), tensorwise (one scale "
        "per operand) and blockwise (DeepSeek-V3's 1 x 128 activation tiles and 128 x 128 "
        "weight blocks). The last tenth: the mean loss of the last tenth of the steps. One "
        "run each.",
        "",
        "| preset | model.fp8 | first loss | last tenth: mean (stdev) | final loss | "
        "last tenth vs bfloat16 |",
        "|---|---|---|---|---|---|",
    ]
    verdicts = []
    for preset, runs in results.items():
        reference = summary(runs["none"])["tail_mean"]
        for recipe, losses in runs.items():
            row = summary(losses)
            change = (row["tail_mean"] - reference) / reference
            lines.append(
                f"| `{preset}` | {recipe} | {row['first']:.4f} | {row['tail_mean']:.4f} "
                f"({row['tail_stdev']:.4f}) | {row['final']:.4f} | {change:+.2%} |"
            )
            if recipe != "none":
                verdicts.append(abs(change) <= BOUND)
    lines += [
        "",
        f"Every FP8 run within {BOUND:.0%} of bfloat16's last-tenth mean: "
        f"{'yes' if all(verdicts) else 'no'}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for preset in args.presets:
            results[preset] = {
                recipe: train(Path(scratch) / f"{preset}-{recipe}", preset, args.steps, recipe)
                for recipe in RECIPES
            }
    text = render(results, args.steps, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
