"""What summing the gradients in bfloat16 does to the loss: ``train.grad_reduce_dtype``
``float32`` against ``bfloat16`` over one run each, the same data, seed and steps.

    python -m experiments.grad_reduce_dtype [--preset tiny] [--steps 200] [--data 4]
        [--expert 2] [--zero 0] [--out FILE]

Trains the preset twice with ``jaxmoe train`` on the 8 fake CPU devices of this host,
``--data`` replicas (the gradients of every parameter are summed over them; the experts'
over the replicas of each expert), at ZeRO stage ``--zero`` (3: the sums are the
reduce-scatters in each block's backward pass), once per dtype, and compares the training
losses step by step: the largest and the mean relative difference, and the mean loss of the
last tenth of the steps of each. Writes ``experiments/results/grad_reduce_dtype.md`` (with
``--zero 3``, ``grad_reduce_dtype_zero3.md``).
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

RESULTS = Path(__file__).parent / "results" / "grad_reduce_dtype.md"
DTYPES = ("float32", "bfloat16")


def train(out: Path, args: argparse.Namespace, dtype: str) -> list[float]:
    """The training losses of one run."""
    from jaxmoe.cli.main import main as jaxmoe

    argv = ["train", "--preset", args.preset, "--steps", str(args.steps), "--out", str(out)]
    argv += ["--parallel.data", str(args.data), "--parallel.expert", str(args.expert)]
    argv += ["--train.zero", str(args.zero)]
    argv += ["--train.grad_reduce_dtype", dtype, "--train.eval_every", str(args.steps)]
    if jaxmoe(argv) != 0:
        raise RuntimeError(f"jaxmoe {' '.join(argv)} failed")
    rows = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["loss"] for row in rows]


def render(losses: dict[str, list[float]], args: argparse.Namespace, argv: list[str]) -> str:
    reference, narrow = losses["float32"], losses["bfloat16"]
    relative = [abs(b - a) / abs(a) for a, b in zip(reference, narrow, strict=True)]
    tail = max(1, len(reference) // 10)
    worst = max(range(len(relative)), key=relative.__getitem__)
    lines = [
        "# Gradients summed in bfloat16: the effect on the loss",
        "",
        f"Command: `{command_line('experiments.grad_reduce_dtype', argv)}`",
        "",
        f"`{args.preset}` for {args.steps} steps on 8 fake CPU devices (data {args.data} x "
        f"expert {args.expert}), ZeRO-{args.zero}, the same data and seed; "
        "`train.grad_reduce_dtype` float32 "
        "against bfloat16 (Megatron-Core's `--grad-reduce-in-bf16`). One run each.",
        "",
        "| | float32 sums | bfloat16 sums |",
        "|---|---|---|",
        f"| first loss | {reference[0]:.4f} | {narrow[0]:.4f} |",
        f"| mean loss, last {tail} steps | {statistics.fmean(reference[-tail:]):.4f} | "
        f"{statistics.fmean(narrow[-tail:]):.4f} |",
        f"| their standard deviation | {statistics.stdev(reference[-tail:]):.4f} | "
        f"{statistics.stdev(narrow[-tail:]):.4f} |",
        f"| final loss | {reference[-1]:.4f} | {narrow[-1]:.4f} |",
        "",
        f"Relative difference of the losses, step by step: mean {statistics.fmean(relative):.2e}"
        f", largest {relative[worst]:.2e} (step {worst}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data", type=int, default=4)
    parser.add_argument("--expert", type=int, default=2)
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 3))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.out = args.out or (
        RESULTS if not args.zero else RESULTS.with_stem(f"{RESULTS.stem}_zero{args.zero}")
    )
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with tempfile.TemporaryDirectory() as runs:
        losses = {dtype: train(Path(runs) / dtype, args, dtype) for dtype in DTYPES}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(losses, args, argv))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
