"""The simulator against the emulated cluster: predicted and measured step times, side by side.

    sudo python -m experiments.simulator_validation [--presets tiny,small] [--quick]

For each preset, one emulated-cluster run (``experiments.cluster``: 2 hosts x 4
devices, a 50 Mbit/s link) measures the real step of every schedule and sweeps
the link's collective costs. Then the simulator predicts the same steps from a
description of that instrument, measured, not fitted to the steps:

- ops: each distinct op timed on all 8 fake devices at once, as in the step,
  where they share the machine's cores (``scheduling.profiling``, what one more
  copy adds); layout ops are free, elementwise ops cost their memory traffic
  (XLA's CPU backend fuses them as the GPU one does);
- collectives: the piecewise-linear curves of the sweep on the shaped link;
- overlap: XLA's CPU backend compiles start/done pairs back to synchronous
  collectives, but its runtime runs independent ops while a collective waits on
  the network, so the program is replayed with its collectives asynchronous.
  The table also gives the other reading, every collective run where its start
  stands with nothing beside it (``asynchronous=False``), to show what overlap
  the instrument has.

The programs simulated are the ones the runs executed: each schedule planned
with the run's own policy. Writes ``experiments/results/simulator_validation.md``.
``--from DIR`` predicts again from a run's saved measurements (``cluster-*.json``
and ``curves-*.json`` in DIR) without the cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SCHEDULES = ("none", "dw", "partition", "lancet")
TOLERANCE = 0.15
# The runs' own planning, as in experiments.lancet_eval: the analytic CPU profile told
# the link's rate, small reductions left synchronous.
PLANNING = [
    "--train.batch_size", "64", "--train.schedule_profile", "cpu",
    "--train.schedule_link_mbit", "50", "--train.schedule_async_min_bytes", "262144",
]  # fmt: skip
LAYOUTS = {"tiny": ("1", "8"), "small": ("2", "4")}


def cluster_argv(preset: str, quick: bool, out: Path, curves: Path) -> list[str]:
    data, expert = LAYOUTS[preset]
    repeats, warmup = ("3", "1") if quick else ("6", "2")
    return [
        "--hosts", "2", "--devices-per-host", "4", "--link-mbit", "50", "--preset", preset,
        "--repeats", repeats, "--warmup", warmup, "--schedules", ",".join(SCHEDULES),
        "--json", str(out), "--sweep", str(curves),
        "--parallel.data", data, "--parallel.expert", expert, *PLANNING,
    ]  # fmt: skip


def predict(preset: str, curves_path: Path, cache: Path) -> dict[str, dict[str, float]]:
    """Simulated step of each schedule; runs in a process with the run's 8 devices."""
    from experiments.cluster import schedule_flags
    from jaxmoe.parallel import build_mesh
    from jaxmoe.train.cli import config_from_train_args
    from jaxmoe.train.scheduled import capture_train_step, schedule_policy
    from scheduling.cost import PROFILES
    from scheduling.link_model import CollectiveCurves
    from scheduling.optimize import batch_inputs, cost_model, node_seconds, plan
    from scheduling.profiling import OpProfiler, ProfiledCostModel
    from scheduling.simulate import simulate

    data, expert = LAYOUTS[preset]
    argv = ["--preset", preset, "--parallel.data", data, "--parallel.expert", expert, *PLANNING]
    config = config_from_train_args(argv)
    mesh = build_mesh(config.parallel)
    # The schedule fields do not change the step: one capture serves every schedule.
    program, sharded = capture_train_step(config, mesh)
    batch = batch_inputs(program, sharded.batch_argnums)
    instrument = replace(PROFILES["cpu"], name="emulated cluster", fused_elementwise=True)
    profiler = OpProfiler(cache, mesh=mesh)
    curves = CollectiveCurves.load(curves_path)
    instrument_cost = ProfiledCostModel(instrument, dict(mesh.shape), profiler, curves)
    predictions = {}
    for schedule in SCHEDULES:
        # Planned as the run planned it: the run's own policy and cost model.
        policy = schedule_policy(config_from_train_args([*argv, *schedule_flags(schedule)]))
        planned = plan(program, policy, cost_model(policy, mesh), batch)
        order = planned.schedule.order
        seconds = node_seconds(instrument_cost)  # memoised per node id: one per graph
        timeline = simulate(planned.graph, order, seconds)
        # The alternative reading of the backend: every collective where its start stands.
        in_place = simulate(planned.graph, order, seconds, asynchronous=False)
        predictions[schedule] = {
            "step_s": timeline.step_seconds,
            "compute_s": timeline.compute_seconds,
            "communication_s": timeline.communication_seconds,
            "exposed_s": timeline.exposed_communication_seconds,
            "in_place_step_s": in_place.step_seconds,
        }
        print(f"  {preset} {schedule}: {timeline.step_seconds * 1e3:.1f} ms predicted")
    profiler.save()
    return predictions


def _table(preset: str, measured: dict, predicted: dict) -> list[str]:
    lines = [
        "| schedule | measured step (ms) | predicted step (ms) | error | predicted compute (ms) "
        "| predicted communication (ms) | predicted exposed (ms) | in place: step (ms) | "
        "in place: error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in measured["schedules"]:
        guess = predicted[row["schedule"]]
        error = guess["step_s"] / row["step_s"] - 1
        in_place_error = guess["in_place_step_s"] / row["step_s"] - 1
        lines.append(
            f"| {row['schedule']} | {row['step_s'] * 1e3:.1f} | {guess['step_s'] * 1e3:.1f} "
            f"| {error:+.1%} | {guess['compute_s'] * 1e3:.1f} "
            f"| {guess['communication_s'] * 1e3:.1f} | {guess['exposed_s'] * 1e3:.1f} "
            f"| {guess['in_place_step_s'] * 1e3:.1f} | {in_place_error:+.1%} |"
        )
    measured_only = measured["communication_only_s"] * 1e3
    lines += ["", f"The step's collectives alone on the shaped link: {measured_only:.1f} ms."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--from", dest="source", type=Path, help="a saved run's directory")
    parser.add_argument("--keep", type=Path, help="save the run's measurements here")
    parser.add_argument("--out", type=Path, default=RESULTS / "simulator_validation.md")
    parser.add_argument("--predict", help=argparse.SUPPRESS)  # worker: preset
    parser.add_argument("--curves", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cache = RESULTS.parent / ".op_costs"

    if args.predict:  # a process with the cluster's 8 devices
        args.rows.write_text(json.dumps(predict(args.predict, args.curves, cache)))
        return 0

    presets = [p for p in args.presets.split(",") if p]
    unknown = sorted(set(presets) - set(LAYOUTS))
    if unknown:
        print(f"--presets: {unknown} not among {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    # The command that reproduces the tables (--from and --keep only move the files).
    command = f"python -m experiments.simulator_validation --presets {','.join(presets)}"
    command += " --quick" if args.quick else ""
    sections = [
        "# Simulator validation",
        "",
        f"Command: `{command}`",
        "",
        "Measured: the emulated cluster's median step (real processes, gloo over a shaped",
        "link). Predicted: the two-stream simulator on the instrument's measured description",
        "(ops profiled on all 8 fake devices at once, collective curves swept on the same",
        "link, collectives replayed asynchronously; see the module docstring). The target",
        f"is an error within {TOLERANCE:.0%} for every schedule. 'In place' replays every",
        "collective where its start stands, with nothing beside it.",
        "",
    ]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        saved = args.source or args.keep or Path(tmp)
        saved.mkdir(parents=True, exist_ok=True)
        for preset in presets:
            measured_path = saved / f"cluster-{preset}.json"
            curves_path = saved / f"curves-{preset}.json"
            if args.source is None:
                from experiments import cluster

                cluster_args = cluster_argv(preset, args.quick, measured_path, curves_path)
                if cluster.main(cluster_args) != 0:
                    return 2
            measured = json.loads(measured_path.read_text())
            rows_path = Path(tmp) / f"predicted-{preset}.json"
            env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
            worker = [sys.executable, "-m", "experiments.simulator_validation"]
            worker += ["--predict", preset, "--curves", str(curves_path), "--rows", str(rows_path)]
            subprocess.run(worker, env=env, check=True)
            predicted = json.loads(rows_path.read_text())
            for row in measured["schedules"]:
                error = predicted[row["schedule"]]["step_s"] / row["step_s"] - 1
                worst = max(worst, abs(error))
            shown = measured["command"].replace(str(measured_path), measured_path.name)
            shown = shown.replace(str(curves_path), curves_path.name)
            sections += [f"## {preset}", "", f"`{shown}`", ""]
            sections += [*_table(preset, measured, predicted), ""]
    verdict = "within" if worst <= TOLERANCE else "outside"
    sections += [f"Largest error: {worst:.1%}, {verdict} the {TOLERANCE:.0%} target.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sections))
    print("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
