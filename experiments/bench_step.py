"""Tokens per second of one training step of a preset.

    python -m experiments.bench_step [--preset tiny] [--steps 30] [--warmup 5]

Compiles the step, runs the warm-up steps, then times each further step to
completion (a fresh batch every step, already on the mesh) and reports the
median. On a CPU host the fake device count is set to the preset's layout.
Writes ``experiments/results/bench_step.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from experiments.shared.results_file import command_line
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results" / "bench_step.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from jaxmoe.parallel.distributed import DistributedConfig
    from jaxmoe.prepare import start_process
    from jaxmoe.presets import preset

    prepared = start_process(preset(args.preset), DistributedConfig())
    config, mesh = prepared.config, prepared.mesh

    import jax

    from jaxmoe.data.batches import put_on_mesh
    from jaxmoe.data.mixture import load_mixture, run_batches
    from jaxmoe.train.state import init_train_state
    from jaxmoe.train.step import build_train_step

    sampler = run_batches(config, load_mixture(config))[0]
    state = init_train_state(resolve(config, mesh))
    batches = [put_on_mesh(sampler, i, mesh) for i in range(args.warmup + args.steps)]
    step = build_train_step(resolve(config, mesh)).jit().lower(state, batches[0]).compile()

    seconds = []
    for index, batch in enumerate(batches):
        started = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        if index >= args.warmup:
            seconds.append(time.perf_counter() - started)

    tokens = config.train.batch_size * config.model.seq_len
    median = statistics.median(seconds)
    tokens_per_s = tokens / median
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, {jax.device_count()} "
        f"{jax.devices()[0].platform} devices, jax {jax.__version__}, Python "
        f"{platform.python_version()}"
    )
    command = command_line("experiments.bench_step", sys.argv[1:] if argv is None else argv)
    layout = f"data {config.parallel.data} x expert {config.parallel.expert}"
    report = "\n".join(
        [
            "# Train-step throughput",
            "",
            f"Command: `{command}`",
            "",
            f"Machine: {machine}.",
            "",
            "| preset | mesh | tokens/step | median step (ms) | min (ms) | max (ms) | tokens/s |",
            "|---|---|---|---|---|---|---|",
            f"| {args.preset} | {layout} | {tokens} | {median * 1e3:.1f} "
            f"| {min(seconds) * 1e3:.1f} | {max(seconds) * 1e3:.1f} | {tokens_per_s:,.0f} |",
            "",
            f"Median of {args.steps} timed steps after {args.warmup} warm-up steps; each step "
            "timed to completion (`block_until_ready`), batch already on the mesh. Fake CPU "
            "devices share the host's cores, so communication here is a memory copy.",
            "",
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
