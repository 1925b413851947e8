"""How long the scheduling layer takes on a whole training step.

    python -m experiments.bench_schedule [--preset gpt2-moe-12] [--schedule dw]

Times, for the preset's train step (abstract arguments: nothing is allocated),
capture (trace + inline), planning (split into start/done pairs, dW placement,
ordering) and emission (rebuilding the step and lowering it to StableHLO).
Writes ``experiments/results/bench_schedule.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from experiments.shared.results_file import command_line
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results" / "bench_schedule.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-moe-12")
    parser.add_argument("--schedule", default="dw", choices=("async", "dw", "partition", "lancet"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from jaxmoe.parallel.distributed import DistributedConfig
    from jaxmoe.prepare import start_process
    from jaxmoe.presets import preset

    prepared = start_process(preset(args.preset), DistributedConfig())
    config, mesh = prepared.config, prepared.mesh

    import jax

    import scheduling
    from jaxmoe.train.scheduled import abstract_step_args, capture_train_step
    from scheduling import batch_inputs, build_report, cost_model, emit, schedule

    example = abstract_step_args(resolve(config, mesh))
    policy = scheduling.SchedulePolicy(name=args.schedule, profile=config.schedule.profile)

    timings = {}
    started = time.perf_counter()
    program, sharded = capture_train_step(resolve(config, mesh))
    timings["capture"] = time.perf_counter() - started
    started = time.perf_counter()
    cost = cost_model(policy, mesh)
    scheduled = schedule(program, policy, cost, batch_inputs(program, sharded.batch_argnums))
    timings["schedule (partition, split, dW, order)"] = time.perf_counter() - started
    started = time.perf_counter()
    report = build_report(scheduled, cost, policy, program)
    timings["report (simulation)"] = time.perf_counter() - started
    started = time.perf_counter()
    step = emit(scheduled.graph, scheduled.order, donate_argnums=sharded.donate_argnums)
    step.lower(*example).as_text()
    timings["emit + lower to StableHLO"] = time.perf_counter() - started
    total = sum(timings.values())

    model = config.model
    command = command_line("experiments.bench_schedule", sys.argv[1:] if argv is None else argv)
    lines = [
        "# Scheduling-layer time on a whole train step",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__}, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices.",
        "",
        f"Preset `{args.preset}`: {model.num_layers} layers, width {model.d_model}, "
        f"{config.moe.num_experts} experts, mesh data {config.parallel.data} x expert "
        f"{config.parallel.expert}; schedule `{args.schedule}`. The program has "
        f"{len(program.ops)} ops and {len(program.collectives())} collectives; "
        f"{report.dw_ops_placed} of {report.dw_ops} dW ops were placed.",
        "",
        "| phase | seconds |",
        "|---|---|",
        *[f"| {name} | {seconds:.2f} |" for name, seconds in timings.items()],
        f"| **total** | **{total:.2f}** |",
        "",
    ]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
