"""Does XLA:GPU keep the planned windows, and what do they buy? One run on a GPU host.

    python -m experiments.gpu_schedule_check [--preset mixtral-tiny] \\
        [--schedules none,dw,lancet,pair] [--microbatches 4] [--steps 20] [--rounds 5]

For each schedule: compile the preset's train step with the scheduler flags
(:data:`scheduling.names.XLA_GPU_FLAGS`), read the planned windows back from the
optimized HLO (:func:`scheduling.broken_windows`: a window is kept when its all-to-all's
start comes first, its done last and computation lies between), then time the steps.
The schedules run round-robin, ``--steps`` steps each per round, so that every ratio to
``none`` is of two measurements taken side by side; the table gives the median over the
rounds and their range. The mesh is the preset's layout over the visible GPUs
(``--expert`` and ``--data`` to change it).

Refuses to run without GPUs: on CPU, XLA runs async pairs synchronously and its HLO order
says nothing about the GPU scheduler. Writes ``experiments/results/gpu_schedule_check.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios

RESULTS = Path(__file__).parent / "results" / "gpu_schedule_check.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mixtral-tiny")
    parser.add_argument("--schedules", default="none,dw,lancet,pair")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--expert", type=int, default=None, help="expert-parallel size")
    parser.add_argument("--data", type=int, default=None, help="data-parallel size")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    import scheduling.names
    from jaxmoe.parallel.host_devices import ensure_xla_flags

    ensure_xla_flags(list(scheduling.names.XLA_GPU_FLAGS))

    import jax

    if jax.devices()[0].platform != "gpu":
        print("gpu_schedule_check needs GPUs: found only", jax.devices()[0].platform)
        return 2

    config = _config(args, jax.device_count())
    results = _measure(config, args)
    text = _report(config, args, results, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


def _config(args: argparse.Namespace, devices: int):
    from jaxmoe.presets import preset

    config = preset(args.preset)
    expert = args.expert or min(devices, config.moe.num_experts)
    data = args.data or devices // expert
    parallel = dataclasses.replace(config.parallel, data=data, expert=expert)
    train = dataclasses.replace(config.train, microbatches=args.microbatches)
    return dataclasses.replace(config, parallel=parallel, train=train)


def _measure(config, args: argparse.Namespace) -> dict[str, dict]:
    import jax

    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.data import BatchSampler, TokenSplits, load_tokens, put_on_mesh
    from jaxmoe.train.scheduled import plan_train_step
    from jaxmoe.train.state import init_train_state

    mesh = build_mesh(config.parallel)
    splits = TokenSplits(load_tokens(config.data), config.data.val_fraction, config.model.seq_len)
    sampler = BatchSampler(
        splits.train, config.model.seq_len, config.train.batch_size, config.train.seed
    )
    batches = [put_on_mesh(sampler, i, mesh) for i in range(args.steps)]

    import scheduling

    steps, results = {}, {}
    for name in args.schedules.split(","):
        schedule = dataclasses.replace(config.schedule, name=name)
        planned = plan_train_step(dataclasses.replace(config, schedule=schedule), mesh)
        compiled = planned.compile()
        windows = scheduling.hlo_windows(compiled.as_text())
        broken = scheduling.broken_windows(compiled.as_text())
        steps[name] = compiled
        results[name] = {"windows": len(windows), "broken": len(broken), "seconds": []}

    state = init_train_state(config, mesh)
    for step in steps.values():  # warm up each, outside the timed rounds
        state, metrics = step(state, batches[0])
        jax.block_until_ready(metrics)
    for _ in range(args.rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            for batch in batches:
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            results[name]["seconds"].append((time.perf_counter() - started) / len(batches))
    return results


def _report(config, args, results: dict[str, dict], argv) -> str:
    import jax

    command = command_line("experiments.gpu_schedule_check", sys.argv[1:] if argv is None else argv)
    tokens = config.train.batch_size * config.model.seq_len
    baseline = results.get("none", {}).get("seconds")
    lines = [
        "# Planned windows on XLA:GPU",
        "",
        f"Command: `{command}`",
        "",
        f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; preset "
        f"`{args.preset}` on data {config.parallel.data} x expert {config.parallel.expert}, "
        f"{config.train.microbatches} microbatches; {args.rounds} rounds of {args.steps} steps.",
        "",
        "| schedule | windows | kept | step ms, median [range] | tokens/s | / none [range] |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        spread = Spread.of(result["seconds"])
        ratio = "-"
        if baseline and name != "none":
            ratio = Spread.of(round_ratios(baseline, result["seconds"])).format(scale=1, digits=2)
        kept = result["windows"] - result["broken"]
        lines.append(
            f"| {name} | {result['windows']} | {kept} | {spread.format()} | "
            f"{tokens / spread.median:,.0f} | {ratio} |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
