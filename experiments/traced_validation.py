"""The simulator against the emulated cluster, with every cost taken from inside the step.

    sudo python -m experiments.traced_validation [--link-mbit 200] [--microbatches 4]
        [--schedules none,...,pair] [--repeats 6] [--keep DIR | --from DIR]

One emulated-cluster run (``experiments.emulation.schedule_runs``) in the regime of
``experiments.emulation.overlap_regime`` (2 hosts x 1 device, ``tiny`` with top-2 and 128
sequences, every all-to-all over the socket transport), here with ``--microbatches``
microbatches so that ``pair`` has partners, measures each schedule on the shaped link in
interleaved rounds, then on the unshaped link, and traces each schedule's step on both
(``experiments.cluster --traces``).

The simulator predicts each schedule's step on the shaped link from the unshaped link's
trace of the same schedule (``instrument_model.traced_readings``): the ops and the
collectives' host work as traced where communication is nearly free, the link as its
calibration measured it. Nothing timed on the shaped link enters a prediction. Each
prediction is set beside the measured step (median, range over rounds); the target is an
error within 15%. Writes ``experiments/results/traced_validation.md``; ``--keep DIR``
saves the run (``cluster-tiny.json``, ``traces/``) and the predictions
(``predicted-tiny.json``, which ``experiments.cross_microbatch_eval --predicted-json``
sets beside its measured rows); ``--from DIR`` predicts again from a saved run, or,
where it was kept without its traces (they take hundreds of MB), writes the section from
its saved predictions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from experiments import simulator_validation as validation
from experiments.emulation import instrument_model as model
from experiments.emulation import overlap_regime as regime
from experiments.emulation.link_calibration import LinkNotCalibrated
from experiments.emulation.schedule_runs import measure_schedules
from experiments.shared.device_process import call_with_devices
from experiments.shared.results_file import command_line
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results"
TOLERANCE = 0.15
PREDICTED = f"predicted-{regime.PRESET}.json"  # beside the saved run's cluster-tiny.json
SCHEDULES = (
    "none", "async", "dw", "partition", "lancet", "expert_pipeline:4", "comet", "lancet+comet",
    "pair",
)  # fmt: skip
READING_NAMES = {
    "traced": "traced",
    "traced_no_host": "traced, no host work",
    "traced_in_place": "traced, in place",
}


def predict(measured_path: str, traces: str) -> dict:
    """Per schedule, the traced readings of its schedule (runs in a process with the
    cluster's devices: ``call_with_devices``)."""
    from experiments.emulation.experimental import saved_config
    from experiments.emulation.socket_transport import CALLBACK_SCOPES
    from experiments.emulation.step_rounds import with_schedule
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.resolved import schedule_policy
    from jaxmoe.train.scheduled import capture_train_step
    from scheduling import (
        batch_inputs,
        cost_model,
        node_seconds,
        read_trace,
        schedule,
        traced_costs,
    )

    measured = json.loads(Path(measured_path).read_text())
    config, _ = saved_config(measured["config"], measured.get("experimental", ()))
    mesh = build_mesh(config.parallel)
    axis_sizes = dict(mesh.shape)
    link = model.link_seconds(measured["link_calibration"], axis_sizes)
    program, sharded = capture_train_step(
        resolve(config, mesh)
    )  # one capture serves every schedule
    batch = batch_inputs(program, sharded.batch_argnums)
    predicted = {}
    for row in measured["schedules"]:
        name = row["schedule"]
        policy = schedule_policy(with_schedule(config, name))
        cost = cost_model(policy, mesh)
        scheduled = schedule(program, policy, cost, batch)
        directory = Path(traces) / "free" / name
        trace = read_trace(directory / "process_0")
        hlo_text = (directory / "step.hlo.txt").read_text()
        costs = traced_costs(
            scheduled.graph, trace, hlo_text, node_seconds(cost), axis_sizes, CALLBACK_SCOPES
        )
        predicted[name] = model.traced_readings(scheduled.graph, scheduled.order.nodes, costs, link)
        print(f"  {name}: {predicted[name]['traced']['step_s'] * 1e3:.1f} ms predicted")
    return predicted


def schedule_table(measured: dict, predicted: dict) -> list[str]:
    """Per schedule: the measured step and speedup over the first schedule, and per
    traced reading the predicted step, its error and its speedup."""
    return validation.schedule_table(measured, predicted, model.TRACED_READINGS, READING_NAMES)


def worst_error(measured: dict, predicted: dict) -> float:
    return validation.worst_error(measured, predicted, "traced")


def breakdown_table(measured: dict, predicted: dict) -> list[str]:
    """What each prediction is made of, beside the unshaped link's measured step."""
    lines = [
        "| schedule | unshaped link: measured step (ms) | traced step (ms) | compute (ms) "
        "| of it, XLA ops naming no planned op (ms) | of it, between ops (ms) "
        "| host work of collectives (ms) | link (ms) | exposed, predicted (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in measured["schedules"]:
        guess = predicted[row["schedule"]]
        cells = [row["compute_only_s"], guess["traced_step_s"], guess["traced_compute_s"]]
        cells += [guess["unattributed_s"], guess["between_ops_s"]]
        cells += [guess["traced_host_s"], guess["link_s"]]
        cells.append(guess["traced"]["exposed_s"])
        lines.append(f"| {row['schedule']} | " + " | ".join(f"{c * 1e3:.1f}" for c in cells) + " |")
    return lines


def reading(measured: dict, predicted: dict) -> list[str]:
    """What the errors say, in figures of this run."""
    errors = {
        row["schedule"]: predicted[row["schedule"]]["traced"]["step_s"] / row["step_s"] - 1
        for row in measured["schedules"]
    }
    no_host = [
        predicted[row["schedule"]]["traced_no_host"]["step_s"] / row["step_s"] - 1
        for row in measured["schedules"]
    ]
    first = measured["schedules"][0]["schedule"]
    baseline = predicted[first]["traced"]["step_s"]
    others = [row for row in measured["schedules"] if row["schedule"] != first]
    guessed = [baseline / predicted[row["schedule"]]["traced"]["step_s"] for row in others]
    speedups = [row["speedup"] for row in others]
    shown = measured.get("overlap_control") or {}
    control = "showed overlap" if shown.get("overlap_shown") else "showed no overlap"
    low = sum(error < 0 for error in errors.values())
    mean = sum(errors.values()) / len(errors)
    spread = [
        (row["step_min_s"] / row["step_s"] - 1, row["step_max_s"] / row["step_s"] - 1)
        for row in measured["schedules"]
    ]
    within = sum(
        row["step_min_s"] <= predicted[row["schedule"]]["traced"]["step_s"] <= row["step_max_s"]
        for row in measured["schedules"]
    )
    return [
        f"- {low} of {len(errors)} predictions are below the measured step; the mean error is "
        f"{mean:+.1%}, from {min(errors.values()):+.1%} to {max(errors.values()):+.1%}. "
        f"{within} of {len(errors)} fall inside the measured range over rounds (whose "
        f"extremes lie {min(lo for lo, _ in spread):+.1%} to {max(hi for _, hi in spread):+.1%}"
        " from the medians).",
        f"- Without the collectives' host work the errors would be {min(no_host):+.1%} to "
        f"{max(no_host):+.1%}"
        + (
            ": the host work measured in the step is what brings the link model within the target."
            if max(map(abs, no_host)) > TOLERANCE
            else ", also within the target: the host work measured in the step brings the "
            f"mean error from {sum(no_host) / len(no_host):+.1%} to {mean:+.1%}."
        ),
        f"- Speedups over `{first}`: predicted {min(guessed):.3f} to {max(guessed):.3f}, "
        f"measured (per-round medians) {min(speedups):.3f} to {max(speedups):.3f}; the "
        f"overlap control in the same run {control}.",
        "- What a prediction leaves out (not measured apart): host work that only the shaped "
        "link causes (the socket sender threads run while bytes are on the wire, beside the "
        "step's computation on the same cores, which the unshaped link's trace cannot show), "
        "and any wait for a peer beyond the skew the unshaped run already holds.",
    ]


HEADER = [
    "# The simulator against the emulated cluster, with costs from inside the step",
    "",
    "Each schedule's step is predicted from that schedule's step traced on the unshaped "
    "link: every op at its traced time, the time between ops and the ops XLA added spread "
    "over the computation, each collective's host work (the socket callbacks, XLA's "
    "collectives) as traced there, and the link from its calibration's size sweep "
    "(`scheduling.traced_costs`, `experiments/emulation/instrument_model.py`). Readings: "
    "`traced` (socket all-to-alls overlap, XLA's collectives run where they stand), the "
    "same without the host work, and nothing overlapping. The earlier descriptions "
    "(`simulator_validation.md`: ops timed alone, a link without host costs) were off by "
    "+25% to +47%, or -17% to -21% with the compute scaled to fit. Target: every schedule "
    f"within {TOLERANCE:.0%}. A run: `sudo python -m experiments.traced_validation --keep "
    "DIR [--link-mbit R]`; each section names the command that wrote it from its kept run "
    "(the traces, hundreds of MB, are not kept here; the measurement and the predictions "
    "are).",
    "",
]


def merged_sections(path: Path, new: list[str]) -> list[str]:
    """The sections of the results file at ``path`` with ``new`` in place of the one of the
    same heading (or added), ordered by heading."""
    text = path.read_text() if path.exists() else ""
    sections = {}
    for chunk in text.split("\n## ")[1:]:
        lines = ("## " + chunk).rstrip().splitlines()
        sections[lines[0]] = [*lines, ""]
    sections[new[0]] = new
    return [line for heading in sorted(sections, key=_link_rate) for line in sections[heading]]


def _link_rate(heading: str) -> float:
    return float(heading.removeprefix("## ").split(" ", 1)[0])


def section(measured: dict, predicted: dict, command: str, made_by: str) -> list[str]:
    config = measured["config"]
    worst = worst_error(measured, predicted)
    return [
        f"## {measured['link_mbit']:g} Mbit/s, {config['train']['microbatches']} microbatches",
        "",
        f"Made by `{made_by}`. Cluster run: `{command}`",
        "",
        regime.summary(measured),
        "",
        *schedule_table(measured, predicted),
        "",
        *breakdown_table(measured, predicted),
        "",
        f"Largest error, traced: {worst:.1%} (target {TOLERANCE:.0%}: "
        f"{'met' if worst <= TOLERANCE else 'NOT met'}).",
        "",
        *reading(measured, predicted),
        "",
    ]


def validate(
    schedules: tuple[str, ...],
    *,
    link_mbit: float,
    microbatches: int,
    repeats: int,
    source: Path | None = None,
    keep: Path | None = None,
) -> tuple[dict, dict, str]:
    """Measure (saved in ``keep``) or read the run saved in ``source``; predict it.
    Returns the measurement, the predictions and the cluster run's command.

    Raises:
        LinkNotCalibrated, HostRunFailed: the cluster run could not be made.
    """
    with tempfile.TemporaryDirectory() as tmp:
        saved = source or keep or Path(tmp)
        saved.mkdir(parents=True, exist_ok=True)
        measured_path, traces = saved / f"cluster-{regime.PRESET}.json", saved / "traces"
        if source is None:
            request = regime.request(
                link_mbit=link_mbit,
                schedules=schedules,
                extra_flags=("--train.microbatches", str(microbatches)),
                traces=traces,
            )
            request = replace(request, repeats=repeats)
            shown = replace(request, traces=Path(traces.name))  # as the saved run names it
            measurement = measure_schedules(request, shown.command(measured_path.name))
            measured_path.write_text(json.dumps(measurement.to_json(), indent=2) + "\n")
        measured = json.loads(measured_path.read_text())
        if source is not None and not traces.exists():  # a run kept without its traces
            return measured, json.loads((source / PREDICTED).read_text()), measured["command"]
        devices = regime.HOSTS * regime.DEVICES_PER_HOST
        predicted = call_with_devices(devices, predict, str(measured_path), str(traces))
        if source is None and keep is not None:
            (keep / PREDICTED).write_text(json.dumps(predicted, indent=1) + "\n")
    return measured, predicted, measured["command"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mbit", type=float, default=200.0)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=6, help="timed interleaved rounds")
    parser.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        help="cluster entries (NAME or NAME:N), the first the baseline of the speedups",
    )
    parser.add_argument("--from", dest="source", type=Path, help="a saved run's directory")
    parser.add_argument("--keep", type=Path, help="save the run's measurements here")
    parser.add_argument("--out", type=Path, default=RESULTS / "traced_validation.md")
    args = parser.parse_args(argv)
    if args.source is not None and not args.source.is_dir():
        parser.error(f"--from {args.source}: no such directory")
    try:
        measured, predicted, command = validate(
            tuple(s for s in args.schedules.split(",") if s),
            link_mbit=args.link_mbit,
            microbatches=args.microbatches,
            repeats=args.repeats,
            source=args.source,
            keep=args.keep,
        )
    except LinkNotCalibrated:
        return 2
    arguments = sys.argv[1:] if argv is None else argv
    made_by = command_line("experiments.traced_validation", arguments)
    new = section(measured, predicted, command, made_by)
    lines = [*HEADER, *merged_sections(args.out, new)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
