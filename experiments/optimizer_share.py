"""How much of a small train step's program is the optimizer update: its equations, its
capture's CPU time and XLA:CPU's compile CPU time, with AdamW (as a run has it) against a
plain SGD update of the same step.

    python -m experiments.optimizer_share [--rounds 3]

The step is the tests' small model (2 layers, one of them MoE, width 32) on the (2, 4)
mesh of 8 fake CPU devices, schedule ``none``. Only the optimizer differs: SGD updates each
parameter with one product and one sum where AdamW keeps two moments, corrects their bias
and decays the weights; the gradients' global norm and the clipping are in both. Each
measurement runs in a process of its own with JAX's compilation cache off (a cached
compile would be a file read); the two variants alternate round by round. Compile times
are at the suite's flags (``tests/conftest.py``: XLA:CPU's backend optimisation off).
Writes ``experiments/results/optimizer_share.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios

RESULTS = Path(__file__).parent / "results" / "optimizer_share.md"
ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("adamw", "sgd")
# The suite's XLA flags (tests/conftest.py).
XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_cpu_emitter_verification_level=0"
)


def _measure(variant: str) -> dict:
    """In a fresh process: the captured step's equations, the capture's CPU seconds and the
    compile's CPU seconds of the step with ``variant``'s update."""
    import dataclasses
    import time

    import optax

    from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step

    config = Config(
        model=ModelConfig(d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16, moe_every=2),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=16, warmup_steps=1, learning_rate=1e-2),
    )
    run = resolve(config, build_mesh(config.parallel))
    if variant == "sgd":
        run = dataclasses.replace(run, optimizer=optax.sgd(run.learning_rate))
    started = time.process_time()
    program, _ = capture_train_step(run)
    capture = time.process_time() - started
    step = scheduled_train_step(run)
    started = time.process_time()
    step.compile()
    compile_seconds = time.process_time() - started
    return {"equations": len(program.ops), "capture": capture, "compile": compile_seconds}


def _run(variant: str) -> dict:
    """:func:`_measure` in a process of its own."""
    import inspect

    code = (
        f"import json\n{inspect.getsource(_measure)}\n"
        f"print(json.dumps({_measure.__name__}({variant!r})))"
    )
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JAX_PLATFORMS="cpu",
        JAX_ENABLE_COMPILATION_CACHE="false",
        XLA_FLAGS=XLA_FLAGS,
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{variant}: the measurement failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rounds: list[dict[str, dict]], argv: list[str]) -> str:
    """The results file: each round's figures of both variants, and the medians, ranges and
    per-round ratios."""
    lines = [
        "# How much of a small step is the optimizer update",
        "",
        f"Command: `{command_line('experiments.optimizer_share', argv)}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores.",
        "",
        "The tests' small step (2 layers, one MoE, width 32; mesh (2, 4); schedule `none`) "
        "with AdamW, as a run has it, against the same step with a plain SGD update; the "
        "global norm and the clipping in both. CPU seconds; each figure from a process of "
        "its own, compilation cache off, the variants alternating round by round.",
        "",
        "| round | variant | equations | capture s | compile s |",
        "|---|---|---|---|---|",
    ]
    for index, found in enumerate(rounds):
        for variant in VARIANTS:
            figures = found[variant]
            lines.append(
                f"| {index + 1} | {variant} | {figures['equations']} | "
                f"{figures['capture']:.2f} | {figures['compile']:.2f} |"
            )
    lines.append("")
    for key in ("capture", "compile"):
        adamw = [found["adamw"][key] for found in rounds]
        sgd = [found["sgd"][key] for found in rounds]
        ratios = round_ratios(sgd, adamw)
        lines.append(
            f"- {key}: AdamW {Spread.of(adamw).format(1, 2)} s, SGD "
            f"{Spread.of(sgd).format(1, 2)} s (median [range]); SGD / AdamW "
            f"{Spread.of(ratios).format(1, 2)}."
        )
    equations = {variant: rounds[0][variant]["equations"] for variant in VARIANTS}
    lines += [
        f"- equations: AdamW {equations['adamw']}, SGD {equations['sgd']} "
        f"({equations['sgd'] / equations['adamw']:.2f}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds = []
    for index in range(args.rounds):
        # Alternate which variant goes first, so neither always runs on a warmer host.
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
        found = {variant: _run(variant) for variant in order}
        rounds.append(found)
        print(f"round {index + 1}: {found}")
    args.out.write_text(report(rounds, argv))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
