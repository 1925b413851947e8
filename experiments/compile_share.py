"""What a small train step's XLA:CPU compile is made of: the tests' small step as the suite
compiles it, against the same step with a plain SGD update (the optimizer's share) and with
bias-free blocks under RMSNorm (the GPT-2-style blocks' biases and LayerNorms' share); and
the compile of each variant's initial state.

    python -m experiments.compile_share [--rounds 3]

The step is the tests' small model (2 layers, one of them MoE, width 32; GPT-2-style
blocks: LayerNorm, biased linear layers) on the (2, 4) mesh of 8 fake CPU devices,
schedule ``none``, with AdamW. ``sgd`` updates each parameter with one product and one sum
where AdamW keeps two moments, corrects their bias and decays the weights (the gradients'
global norm and the clipping are in both). ``lean`` has ``model.linear_bias false`` and
``model.norm rmsnorm``: 18 parameters where the reference has 29. Each measurement runs in
a process of its own with JAX's compilation cache off (a cached compile would be a file
read); the variants take turns, their order rotating round by round. Compile times are at
the suite's flags (``tests/conftest.py``: XLA:CPU's backend optimisation off). Writes
``experiments/results/compile_share.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

from experiments.shared.other_tree import run_in_tree
from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios

RESULTS = Path(__file__).parent / "results" / "compile_share.md"
ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "adamw"
VARIANTS = (REFERENCE, "sgd", "lean")
# Figures per variant and measurement: counts (the same every round) and CPU seconds.
COUNTS = ("parameters", "equations", "fusions")
SECONDS = ("capture", "compile", "init_compile")
# The suite's XLA flags (tests/conftest.py).
XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
    "--xla_cpu_emitter_verification_level=0"
)


def _measure(variant: str) -> dict:
    """In a fresh process: the step's parameters, captured equations and compiled fusions;
    the CPU seconds of its capture, its compile, and the compile of its initial state."""
    import dataclasses
    import time

    import jax
    import optax

    from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step
    from jaxmoe.train.state import init_train_state

    lean = dict(linear_bias=False, norm="rmsnorm") if variant == "lean" else {}
    config = Config(
        model=ModelConfig(
            d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=16, moe_every=2, **lean
        ),
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
    lowered = step.step.lower(*step.example)
    started = time.process_time()
    compiled = lowered.compile()
    compile_seconds = time.process_time() - started
    started = time.process_time()
    jax.block_until_ready(init_train_state(run))  # traced, lowered and compiled
    init_seconds = time.process_time() - started
    return {
        "parameters": len(jax.tree.leaves(run.state_shapes.params)),
        "equations": len(program.ops),
        "fusions": compiled.as_text().count(" fusion("),
        "capture": capture,
        "compile": compile_seconds,
        "init_compile": init_seconds,
    }


def _run(variant: str) -> dict:
    """:func:`_measure` in a process of its own."""
    environment = {"JAX_ENABLE_COMPILATION_CACHE": "false", "XLA_FLAGS": XLA_FLAGS}
    return run_in_tree(ROOT, _measure, (variant,), environment)


def report(rounds: list[dict[str, dict]], argv: list[str]) -> str:
    """The results file: each round's figures of every variant; the counts; and per figure
    of time, each variant's median and range, and its ratio to the reference's taken round
    by round."""
    lines = [
        "# What a small step's compile is made of",
        "",
        f"Command: `{command_line('experiments.compile_share', argv)}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores.",
        "",
        "The tests' small step (2 layers, one MoE, width 32, GPT-2-style blocks; mesh "
        "(2, 4); schedule `none`; AdamW) against the same step with a plain SGD update "
        "(`sgd`: the global norm and the clipping in both) and with bias-free blocks "
        "under RMSNorm (`lean`). CPU seconds; each figure from a process of its own, "
        "compilation cache off, the variants taking turns in an order rotating round by "
        "round. `init compile`: tracing, lowering and compiling the initial state.",
        "",
        "| round | variant | parameters | equations | fusions | capture s | compile s "
        "| init compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, found in enumerate(rounds):
        for variant in VARIANTS:
            f = found[variant]
            lines.append(
                f"| {index + 1} | {variant} | {f['parameters']} | {f['equations']} | "
                f"{f['fusions']} | {f['capture']:.2f} | {f['compile']:.2f} | "
                f"{f['init_compile']:.2f} |"
            )
    lines.append("")
    reference = rounds[0][REFERENCE]
    for variant in VARIANTS[1:]:
        counts = ", ".join(
            f"{key} {rounds[0][variant][key]} against {reference[key]} "
            f"({rounds[0][variant][key] / reference[key]:.2f})"
            for key in COUNTS
        )
        lines.append(f"- {variant}: {counts}.")
    for key in SECONDS:
        base = [found[REFERENCE][key] for found in rounds]
        parts = [f"{REFERENCE} {Spread.of(base).format(1, 2)} s"]
        for variant in VARIANTS[1:]:
            values = [found[variant][key] for found in rounds]
            ratios = round_ratios(values, base)
            parts.append(
                f"{variant} {Spread.of(values).format(1, 2)} s, "
                f"{variant} / {REFERENCE} {Spread.of(ratios).format(1, 2)}"
            )
        lines.append(f"- {key.replace('_', ' ')} (median [range]): {'; '.join(parts)}.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds = []
    for index in range(args.rounds):
        # Rotate which variant goes first, so none always runs on a warmer host.
        shift = index % len(VARIANTS)
        order = VARIANTS[shift:] + VARIANTS[:shift]
        found = {variant: _run(variant) for variant in order}
        rounds.append(found)
        print(f"round {index + 1}: {found}")
    args.out.write_text(report(rounds, argv))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
