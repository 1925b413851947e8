"""ZeRO-3's weight gathers under the scheduler: how far ahead each is started.

    python -m experiments.zero3_prefetch

A scheduled step starts a collective as soon as its operand exists; a ZeRO-3 gather's
operand is a weight shard, an argument of the step, so without a bound every block's
gather starts with the step and its gathered weights stay alive until the block runs.
``schedule.prefetch_lead`` bounds it (``scheduling/passes/prefetch.py``): a gather starts
where the compute before its first use is estimated at ``lead`` times its own time. This
plans one ZeRO-3 step (schedule ``async``, the simulator: cost model and two-stream
timeline, on 8 fake CPU devices) under several leads and reports, per lead: the simulated
step, the parameter gathers' time and the part of it the compute waited for, the most
gathered weight bytes in flight at once (started, block not yet run), and the live bytes
at the forward pass's peak and at the step's (the scheduler's count).

Writes ``experiments/results/zero3_prefetch.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.shared.results_file import command_line
from jaxmoe.train.resolved import resolve

MODULE = "experiments.zero3_prefetch"
RESULTS = Path(__file__).parent / "results" / "zero3_prefetch.md"
LEADS = (0.0, 1.0, 2.0, 4.0)
PROFILES = ("a100", "h100-8x-nvlink-3200g")


def zero3_config(profile: str, lead: float):
    from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
    from jaxmoe.config.schedule import ScheduleConfig

    return Config(
        model=ModelConfig(
            d_model=256, num_heads=4, num_layers=8, d_ff=1024, seq_len=128, moe_every=2
        ),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.25),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=16, warmup_steps=1, zero=3),
        schedule=ScheduleConfig(name="async", profile=profile, prefetch_lead=lead),
    )


def measure(profile: str, lead: float, program=None) -> tuple[dict, object]:
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.resolved import schedule_policy
    from jaxmoe.train.scheduled import capture_train_step
    from scheduling import (
        Phase,
        build_report,
        cost_model,
        gathers_in_flight_bytes,
        peak_live_bytes,
        schedule,
    )

    config = zero3_config(profile, lead)
    mesh = build_mesh(config.parallel)
    if program is None:
        program, _ = capture_train_step(resolve(config, mesh))
    policy = schedule_policy(config)
    cost = cost_model(policy, mesh)
    scheduled = schedule(program, policy, cost)
    report = build_report(scheduled, cost, policy, program)
    graph, order = scheduled.graph, scheduled.order.nodes
    position = {node: i for i, node in enumerate(order)}
    forward_end = min(
        position[n.id] for n in graph.nodes if n.op.phase is not Phase.FORWARD
    )  # the first op of the backward pass (or the update)
    gathers = [c for c in report.collectives if "parameter" in c.purpose]
    return {
        "profile": profile,
        "lead": lead,
        "step_s": report.step_seconds,
        "gathers": len(gathers),
        "gather_s": sum(c.estimated_seconds for c in gathers),
        "gather_exposed_s": sum(c.estimated_seconds - c.overlap_seconds for c in gathers),
        "most_in_flight_bytes": gathers_in_flight_bytes(graph, order),
        "forward_peak_bytes": peak_live_bytes(graph, order, until=forward_end),
        "peak_bytes": report.peak_live_bytes,
    }, program


def report(rows: list[dict], command: str) -> str:
    lines = [
        "# ZeRO-3 weight gathers: the scheduler's prefetch",
        "",
        f"Command: `{command}`",
        "",
        "The simulator on one ZeRO-3 step (8 layers of width 256, an MoE every other layer "
        "of 8 experts, top 2; 128 positions, 16 sequences; data 2 x expert 4; schedule "
        "`async`), scheduled under each `schedule.prefetch_lead`; 0 starts every gather with "
        "the step. *In flight*: the most gathered weight bytes started and not yet used at "
        "once. *Forward peak*, *step peak*: live bytes by the scheduler's count "
        "(`scheduling.order.list_scheduler.peak_live_bytes`), over the forward pass and over the "
        "whole step. Per device.",
        "",
        "| profile | lead | step (ms) | / lead 0 | parameter gathers | their time (ms) "
        "| compute waited for them (ms) | in flight (MiB) | forward peak (MiB) "
        "| step peak (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {row["profile"]: row for row in rows if row["lead"] == 0}
    for row in rows:
        lines.append(
            f"| {row['profile']} | {row['lead']:g} | {row['step_s'] * 1e3:.3f} | "
            f"{row['step_s'] / base[row['profile']]['step_s']:.4f} | {row['gathers']} | "
            f"{row['gather_s'] * 1e3:.3f} | {row['gather_exposed_s'] * 1e3:.3f} | "
            f"{row['most_in_flight_bytes'] / 2**20:.2f} | "
            f"{row['forward_peak_bytes'] / 2**20:.2f} | {row['peak_bytes'] / 2**20:.2f} |"
        )
    lines += ["", *reading(rows)]
    return "\n".join(lines) + "\n"


def reading(rows: list[dict]) -> list[str]:
    out = []
    for profile in PROFILES:
        mine = {row["lead"]: row for row in rows if row["profile"] == profile}
        none, two = mine[0.0], mine[2.0]
        out.append(
            f"- {profile}: started with the step, the gathers hold "
            f"{none['most_in_flight_bytes'] / 2**20:.2f} MiB of gathered weights at once "
            f"and the compute waits {none['gather_exposed_s'] * 1e3:.3f} ms for them; with "
            f"the default lead of 2, {two['most_in_flight_bytes'] / 2**20:.2f} MiB "
            f"({two['most_in_flight_bytes'] / max(1, none['most_in_flight_bytes']):.2f}x), "
            f"a wait of {two['gather_exposed_s'] * 1e3:.3f} ms, a forward peak "
            f"{two['forward_peak_bytes'] / max(1, none['forward_peak_bytes']):.2f}x and a "
            f"step {two['step_s'] / none['step_s']:.4f}x lead 0's."
        )
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from jaxmoe.parallel.host_devices import ensure_host_devices

    ensure_host_devices(8)
    rows, program = [], None
    for profile in PROFILES:
        for lead in LEADS:
            row, program = measure(profile, lead, program)
            rows.append(row)
            print(f"{profile} lead {lead:g}: {row['step_s'] * 1e3:.3f} ms", flush=True)
    text = report(rows, command_line(MODULE, argv))
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
