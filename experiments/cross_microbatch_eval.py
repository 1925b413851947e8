"""Hiding the all-to-all across microbatches: the simulator at scale.

    python -m experiments.cross_microbatch_eval [--microbatches 4] [--quick] [--gpus 8,16]
        [--jobs N]

The simulator (cost model and two-stream timeline) on the step with ``--microbatches``
microbatches, scheduled by ``none``, ``lancet`` (within each microbatch), ``pair`` (microbatch
i's backward beside microbatch i+2's forward, the first two forward and the last two
backward passes together, dW in the windows left) and ``lancet`` with
the pairing (``pair_microbatches``):

- the Lancet paper's scale: GPT-2 MoE 12 x 768 and 24 x 1024 (``experiments.lancet_eval``'s
  configuration) on 16 and 32 GPUs of the 8xA100 and 8xV100 profiles;
- the Mixtral-8x7B shape on 8, 16 and 32 H100s (expert parallel over the GPUs, 4 sequences
  of 4096 tokens per GPU), cut to ``--mixtral-layers`` layers: every layer is alike, so the
  fractions hidden and the speedups are those of the whole depth, which only adds alike
  windows (the step time is given for the layers simulated).

Each row gives the exposed all-to-all (the time the compute stream waits for an
all-to-all), its reduction against ``none``, the speedup, and the ideal step — the
simulator's lower bound for any schedule of the program, max(compute, communication) —
with the speedup it allows. Targets (the issue's): at least 90% of the exposed all-to-all
hidden, and 1.3x where the bound allows it.

Writes the simulator section of ``experiments/results/cross_microbatch_eval.md`` and keeps
the emulated-cluster section an earlier run put there. ``--cluster-json FILE`` writes that
section instead, from an ``experiments.cluster --json`` measurement of the schedules (the
best against ``none`` per round, the exposed communication's cut, the overlap control),
and keeps the simulator section; with ``--predicted-json FILE`` (the predictions
``experiments.traced_validation`` made of that measurement) the section sets the
simulator's prediction beside each measured row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments.lancet_eval import MODELS, paper_config
from experiments.shared.device_process import call_with_devices
from experiments.shared.results_file import command_line, kept_section
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results" / "cross_microbatch_eval.md"
CLUSTER_HEADING = "## (a) Emulated cluster"
SIMULATOR_HEADING = "## (b) Simulator at scale"
# Name in the tables -> (policy, pair_microbatches).
SCHEDULES = {
    "none": ("none", False),
    "lancet": ("lancet", False),
    "pair": ("pair", False),
    "lancet+pair": ("lancet", True),
}
TARGET_HIDDEN, TARGET_SPEEDUP = 0.90, 1.3


def _mixtral(gpus: int, layers: int, microbatches: int):
    from jaxmoe.config import ParallelConfig
    from jaxmoe.presets import preset

    config = preset("mixtral-8x7b")
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, num_layers=layers),
        parallel=ParallelConfig(data=gpus // 8, expert=8) if gpus > 8 else ParallelConfig(),
        train=dataclasses.replace(config.train, batch_size=4 * gpus, microbatches=microbatches),
    )


def _paper(model: str, gpus: int, microbatches: int):
    config = paper_config(*MODELS[model], gpus)
    return dataclasses.replace(
        config, train=dataclasses.replace(config.train, microbatches=microbatches)
    )


def simulate(gpus: int, cases: list[list[str]], microbatches: int, layers: int) -> list[dict]:
    """Rows for ``gpus`` devices; ``cases``: (model, profile) pairs. Runs in a process with
    that many fake devices (``call_with_devices``)."""
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.scheduled import capture_train_step
    from scheduling import SchedulePolicy, batch_inputs, build_report, cost_model, schedule

    rows = []
    for model, profile in cases:
        if model == "mixtral-8x7b":
            config = _mixtral(gpus, layers, microbatches)
            name = f"Mixtral-8x7B ({layers} of 32 layers)"
        else:
            config = _paper(model, gpus, microbatches)
            name = model
        mesh = build_mesh(config.parallel)
        program, sharded = capture_train_step(resolve(config, mesh))
        batch = batch_inputs(program, sharded.batch_argnums)
        for label, (policy_name, pairing) in SCHEDULES.items():
            policy = SchedulePolicy(name=policy_name, profile=profile, pair_microbatches=pairing)
            cost = cost_model(policy, mesh)
            report = build_report(schedule(program, policy, cost, batch), cost, policy, program)
            exchanges = [c for c in report.collectives if c.kind == "all_to_all"]
            rows.append(
                {
                    "config": f"{name}, {gpus} GPUs, {profile}",
                    "schedule": label,
                    "step_s": report.step_seconds,
                    "all_to_all_s": sum(c.estimated_seconds for c in exchanges),
                    "all_to_all_exposed_s": sum(
                        c.estimated_seconds - c.overlap_seconds for c in exchanges
                    ),
                    "ideal_s": report.ideal_step_seconds,
                }
            )
            print(f"  {rows[-1]['config']} {label}: {report.step_seconds * 1e3:.2f} ms")
    return rows


def simulate_all(
    runs: dict[int, list[list[str]]], microbatches: int, layers: int, jobs: int = 1
) -> list[dict]:
    """The rows of every configuration of ``runs`` (GPU count -> cases), in that order,
    each configuration in a process of its own, ``jobs`` of them at once (the simulator is
    deterministic: the rows are those of one process running them all)."""

    def one(call: tuple[int, list[str]]) -> list[dict]:
        gpus, case = call
        return call_with_devices(gpus, simulate, gpus, [case], microbatches, layers)

    calls = [(gpus, case) for gpus, cases in runs.items() for case in cases]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return [row for rows in pool.map(one, calls) for row in rows]


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| configuration | schedule | step (ms) | all-to-all (ms) | exposed all-to-all (ms) "
        "| hidden vs none | speedup vs none | ideal step (ms) | speedup bound | targets |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    baseline = {row["config"]: row for row in rows if row["schedule"] == "none"}
    for row in rows:
        none = baseline[row["config"]]
        hidden = 1 - row["all_to_all_exposed_s"] / none["all_to_all_exposed_s"]
        speedup = none["step_s"] / row["step_s"]
        bound = none["step_s"] / row["ideal_s"]
        if row["schedule"] == "none":
            verdict = ""
        else:
            met = [f"hidden {'met' if hidden >= TARGET_HIDDEN else 'not met'}"]
            if bound >= TARGET_SPEEDUP:
                met.append(f"1.3x {'met' if speedup >= TARGET_SPEEDUP else 'not met'}")
            else:
                met.append("1.3x out of reach")
            verdict = ", ".join(met)
        lines.append(
            f"| {row['config']} | {row['schedule']} | {row['step_s'] * 1e3:.2f} | "
            f"{row['all_to_all_s'] * 1e3:.2f} | {row['all_to_all_exposed_s'] * 1e3:.2f} | "
            f"{hidden:.0%} | {speedup:.3f}x | {row['ideal_s'] * 1e3:.2f} | {bound:.3f}x | "
            f"{verdict} |"
        )
    return lines


def summary(rows: list[dict]) -> list[str]:
    """Each configuration's best schedule against the targets, and the count that meets
    them."""
    none = {row["config"]: row for row in rows if row["schedule"] == "none"}
    best: dict[str, dict] = {}
    for row in rows:
        if row["schedule"] != "none" and (
            row["config"] not in best or row["step_s"] < best[row["config"]]["step_s"]
        ):
            best[row["config"]] = row
    lines, hidden_met, reachable, speedup_met = [], 0, 0, 0
    for config, row in best.items():
        base = none[config]
        hidden = 1 - row["all_to_all_exposed_s"] / base["all_to_all_exposed_s"]
        speedup, bound = base["step_s"] / row["step_s"], base["step_s"] / row["ideal_s"]
        hidden_met += hidden >= TARGET_HIDDEN
        reachable += bound >= TARGET_SPEEDUP
        speedup_met += bound >= TARGET_SPEEDUP and speedup >= TARGET_SPEEDUP
        lines.append(
            f"- {config}: `{row['schedule']}`, {hidden:.0%} of the exposed all-to-all hidden, "
            f"{speedup:.3f}x (bound {bound:.3f}x)"
        )
    return [
        "Best schedule of each configuration:",
        "",
        *lines,
        "",
        f"90% hidden: met in {hidden_met} of {len(best)} configurations. 1.3x: met in "
        f"{speedup_met} of the {reachable} whose bound allows it.",
    ]


def predicted_table(report: dict, predicted: dict) -> list[str]:
    """Each measured row beside the simulator's prediction of it (``traced`` reading)."""
    from experiments.shared.spread import Spread

    first = predicted[report["schedules"][0]["schedule"]]["traced"]["step_s"]
    lines = [
        "| schedule | measured step (ms) | predicted step (ms) | error | measured speedup, "
        "per round | predicted speedup | predicted exposed communication (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["schedules"]:
        guess = predicted[row["schedule"]]["traced"]
        step = Spread(row["step_s"], row["step_min_s"], row["step_max_s"])
        speedup = Spread(row["speedup"], row["speedup_min"], row["speedup_max"])
        lines.append(
            f"| {row['schedule']} | {step.format()} | {guess['step_s'] * 1e3:.1f} "
            f"| {guess['step_s'] / row['step_s'] - 1:+.1%} | {speedup.format(1, 3)} "
            f"| {first / guess['step_s']:.3f} | {guess['exposed_s'] * 1e3:.1f} |"
        )
    return lines


def cluster_section(report: dict, predicted: dict | None = None) -> list[str]:
    """Section (a) from an ``experiments.cluster --json`` measurement of the schedules,
    with the simulator's predictions of it where given."""
    from experiments.emulation.schedule_runs import format_table
    from experiments.shared.spread import Spread

    rows = {row["schedule"]: row for row in report["schedules"]}
    none = rows["none"]
    best = min((r for name, r in rows.items() if name != "none"), key=lambda r: r["step_s"])
    cut = 1 - best["exposed_communication_s"] / none["exposed_communication_s"]
    speedup = Spread(best["speedup"], best["speedup_min"], best["speedup_max"])
    control = report.get("overlap_control")
    lines = [
        CLUSTER_HEADING,
        "",
        f"Command: `{report['command']}`",
        "",
        "Real steps on the emulated cluster (`experiments/cluster.py`), every all-to-all over "
        "the socket transport in every schedule (`none` waits for each right after its start), "
        "the schedules in interleaved rounds. *Exposed communication*: the step minus the same "
        "step on the unshaped link (the gradient reductions' share included).",
        "",
        format_table(report),
        "",
    ]
    if predicted is not None:
        lines += [
            "The simulator's prediction of each row (`experiments/traced_validation.py`: op "
            "costs and the collectives' host work from each schedule's step traced on the "
            "unshaped link, the link from its calibration; nothing timed on the shaped link):",
            "",
            *predicted_table(report, predicted),
            "",
        ]
    if control is not None:
        ratios = Spread.of(control["chained_over_independent"])
        verdict = "overlap shown" if control["overlap_shown"] else "no overlap shown"
        lines += [
            f"Overlap control on the same hosts and link: chained over independent per round "
            f"{ratios.format(1, 3)}, {verdict}.",
            "",
        ]
    # What none spends communicating; overlapped fully, the step is the longer of the two.
    communicating = none["step_s"] - none["compute_only_s"]
    met_speedup = "met" if speedup.median >= TARGET_SPEEDUP else "not met"
    met_cut = "met" if cut >= 0.8 else "not met"
    lines += [
        f"Best schedule: `{best['schedule']}`, {speedup.format(1, 3)}x `none` per round "
        f"(target 1.3x: {met_speedup}); exposed communication "
        f"{best['exposed_communication_s'] * 1e3:.1f} ms against "
        f"{none['exposed_communication_s'] * 1e3:.1f} ms, cut by {cut:.0%} (target 80%: "
        f"{met_cut}). `none`'s step spends {none['compute_only_s'] * 1e3:.1f} ms computing "
        f"(its compute-only step) of {none['step_s'] * 1e3:.1f} ms: overlapping all of it would "
        f"give at most {none['step_s'] / max(none['compute_only_s'], communicating):.3f}x.",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--mixtral-layers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="16 GPUs only")
    parser.add_argument(
        "--gpus", help="comma-separated GPU counts to simulate (default: 8, 16 and 32)"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="configurations simulated at once, one process each"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--cluster-json",
        type=Path,
        help="write section (a) from this experiments.cluster --json measurement, and keep "
        "the simulator section an earlier run wrote",
    )
    parser.add_argument(
        "--rows-json",
        type=Path,
        help="write the simulator section from the rows an earlier run saved (its .json)",
    )
    parser.add_argument(
        "--predicted-json",
        type=Path,
        help="with --cluster-json: experiments.traced_validation's predictions of it",
    )
    args = parser.parse_args(argv)
    if args.predicted_json is not None and args.cluster_json is None:
        parser.error("--predicted-json needs --cluster-json (the measurement it predicts)")
    if args.cluster_json is not None:
        predicted = None
        if args.predicted_json is not None:
            predicted = json.loads(args.predicted_json.read_text())
        section = cluster_section(json.loads(args.cluster_json.read_text()), predicted)
        kept = kept_section(args.out, SIMULATOR_HEADING, None, "--cluster-json")
        head = args.out.read_text().split(CLUSTER_HEADING)[0].split(SIMULATOR_HEADING)[0]
        args.out.write_text(head + "\n".join([*section, *kept]))
        return 0

    paper = [
        [model, profile]
        for model in MODELS
        for profile in ("a100-8x-nvlink-400g", "v100-8x-nvlink-100g")
    ]
    mixtral = [["mixtral-8x7b", "h100-8x-nvlink-3200g"]]
    runs = {16: paper + mixtral} if args.quick else {8: mixtral, 16: paper + mixtral}
    if not args.quick:
        runs[32] = paper + mixtral
    if args.gpus:
        runs = {int(n): runs.get(int(n), paper + mixtral) for n in args.gpus.split(",")}
    arguments = sys.argv[1:] if argv is None else argv
    command = command_line("experiments.cross_microbatch_eval", arguments)
    if args.rows_json:  # the rows, and the command that simulated them
        saved = json.loads(args.rows_json.read_text())
        rows, command = saved["rows"], saved["command"]
    else:
        rows = simulate_all(runs, args.microbatches, args.mixtral_layers, args.jobs)
    lines = [
        "# Hiding the all-to-all across microbatches",
        "",
        f"Command: `{command}`",
        "",
        *kept_section(args.out, CLUSTER_HEADING, SIMULATOR_HEADING, "cross_microbatch_eval"),
        SIMULATOR_HEADING,
        "",
        f"{args.microbatches} microbatches per step. Exposed all-to-all: the time the compute",
        "stream waits for an all-to-all on the simulated timeline. Ideal step: max(compute,",
        "communication) of the program, the bound for any schedule. Targets: 90% of the",
        "exposed all-to-all hidden; 1.3x where the bound allows it.",
        "",
        *table(rows),
        "",
        *summary(rows),
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    saved = {"command": command, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(saved, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
