"""The simulator against the emulated cluster: first the overlap control, then the schedules.

    sudo python -m experiments.simulator_validation [--link-mbit 50] [--shaped-only]
        [--compute-only-from RUN.json] [--quick] [--keep DIR | --from DIR]
        [--schedules none,async,partition,lancet]

One emulated-cluster run (``experiments.emulation.schedule_runs``, ``experiments.cluster``'s
measurement) measures the instrument in the regime of
``experiments.emulation.overlap_regime`` (2 hosts x 1 device, ``tiny`` with top-2 and 128
sequences, every all-to-all over the socket transport; a calibrated 50 Mbit/s link unless
``--link-mbit`` says otherwise), with the overlap control beside the schedules, the step on
the unshaped link (compute-only; ``--shaped-only`` skips it and takes it from
``--compute-only-from``), and a sweep of the link's collective costs. Then the simulator
predicts, from the instrument's measured description and in four readings
(``experiments.emulation.instrument_model``), first the control's three forms (with
``lax.all_to_all``, so that the simulator sees the exchanges, in the order their socket
forms run), set against the measured per-round ratios, then each schedule, planned as the
run planned it. Writes one section per run to ``--out``; ``--keep DIR`` saves the run's
measurements (``cluster-tiny.json``, ``curves-tiny.json``), ``--from DIR`` predicts again
from them without the cluster. ``validate`` is the whole of it as a function
(``experiments.comet_cluster`` calls it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from experiments.emulation import instrument_model as model
from experiments.emulation import overlap_regime as regime
from experiments.emulation.link_calibration import LinkNotCalibrated
from experiments.emulation.schedule_runs import measure_schedules
from experiments.shared.device_process import call_with_devices
from experiments.shared.spread import Spread, round_ratios
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results"
OP_COSTS = RESULTS.parent / ".op_costs"
TOLERANCE = 0.15


def _plans(link_mbit: float, cost, schedules: list[str]) -> dict:
    """Each schedule's graph, order and what its search did (partitioned ranges, MoE
    layers decomposed), scheduled as the run scheduled it (its own policy and cost model)."""
    from experiments.emulation.experimental import experimental_config
    from experiments.emulation.step_rounds import with_schedule
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.resolved import schedule_policy
    from jaxmoe.train.scheduled import capture_train_step
    from scheduling import batch_inputs, cost_model, schedule

    argv = ["--preset", regime.PRESET, *regime.train_flags(link_mbit)]
    config, _ = experimental_config(argv)
    mesh = build_mesh(config.parallel)
    # The schedule fields do not change the step: one capture serves every schedule.
    program, sharded = capture_train_step(resolve(config, mesh))
    batch = batch_inputs(program, sharded.batch_argnums)
    plans = {}
    for name in schedules:
        policy = schedule_policy(with_schedule(config, name))
        scheduled = schedule(program, policy, cost_model(policy, mesh), batch)
        ranges = [
            f"ops {c.cut.begin}-{c.cut.end - 1} in {c.cut.n} chunks" for c in scheduled.partitions
        ]
        decomposed = [f"{c.layer} {c.chosen}" for c in scheduled.exchanges if c.chosen]
        done = {"partitions": ranges, "exchanges": decomposed}
        plans[name] = (scheduled.graph, scheduled.order.nodes, done)
    return plans


def _control_plans(mesh, settings: dict) -> dict:
    """The control's forms with ``lax.all_to_all`` over the expert axis of ``mesh`` (the
    step's, whose devices the op profiler times), in the order their socket forms run."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from experiments.emulation.overlap_control import ControlProgram, per_device_forms
    from jaxmoe.parallel.mesh import EXPERT_AXIS
    from scheduling import Graph, capture

    program = ControlProgram(
        "xla", settings["rows"], settings["width"], settings["layers"], settings["chunks"]
    )
    specs = (PartitionSpec(EXPERT_AXIS), PartitionSpec())
    x = jax.ShapeDtypeStruct(
        (program.rows * mesh.devices.size, program.width),
        "float32",
        sharding=NamedSharding(mesh, specs[0]),
    )
    w = jax.ShapeDtypeStruct(
        (program.width, program.width), "float32", sharding=NamedSharding(mesh, specs[1])
    )
    plans = {}
    for form, body in per_device_forms(EXPERT_AXIS, program).items():
        program = capture(body, x, w, mesh=mesh, in_specs=specs, out_specs=specs[0])
        graph = Graph(program, split=lambda op: op.primitive == "all_to_all")
        plans[form] = (graph, model.pipelined_order(graph), {"partitions": [], "exchanges": []})
    return plans


def predict(measured_path: str, curves_path: str, cache: str, compute_only_s: float) -> dict:
    """Runs in a process with the cluster's devices (one per host: ``call_with_devices``).
    ``compute_only_s``: the measured step of ``none`` on the unshaped link (for the
    ``scaled`` reading)."""
    from experiments.emulation.experimental import experimental_config
    from jaxmoe.parallel.mesh import build_mesh
    from scheduling import node_seconds, simulate

    measured_path, curves_path, cache = Path(measured_path), Path(curves_path), Path(cache)
    measured = json.loads(measured_path.read_text())
    link_mbit = measured["link_mbit"]
    config, _ = experimental_config(["--preset", regime.PRESET, *regime.train_flags(link_mbit)])
    mesh = build_mesh(config.parallel)
    cost = model.instrument_cost(mesh, curves_path, measured["link_calibration"], cache)
    control = measured["overlap_control"]
    groups = {
        "schedules": _plans(link_mbit, cost, [row["schedule"] for row in measured["schedules"]]),
        "control": _control_plans(mesh, {"rows": control["rows_per_device"], **control}),
    }
    graph, order, _ = groups["schedules"]["none"]
    none_compute = simulate(graph, order, node_seconds(cost)).compute_seconds
    factor = compute_only_s / none_compute
    result: dict = {"compute_scale": factor}
    for group, plans in groups.items():
        result[group] = {}
        for name, (graph, order, done) in plans.items():
            result[group][name] = model.readings(graph, order, node_seconds(cost), factor)
            result[group][name].update(done)
            step = result[group][name]["instrument"]["step_s"]
            print(f"  {group} {name}: {step * 1e3:.1f} ms predicted")
    cost.profiler.save()
    return result


# -- the tables -----------------------------------------------------------------------------

READING_NAMES = {
    "instrument": "instrument",
    "scaled": "instrument, compute scaled",
    "all_async": "all asynchronous",
    "in_place": "in place",
}


def _planning_lines(schedules: dict) -> list[str]:
    """What each schedule's own planning did: partitioned ranges, decomposed exchanges."""
    lines = []
    for key, what in (("partitions", "Forward ranges partitioned"), ("exchanges", "MoE layers")):
        done = [
            f"{name}: {', '.join(plan.get(key, [])) or 'none'}"
            for name, plan in schedules.items()
            if (key == "partitions" and name in ("partition", "lancet")) or plan.get(key)
        ]
        if done:
            lines.append(f"{what} by the run's own planning: {'; '.join(done)}.")
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def control_table(control: dict, predicted: dict) -> list[str]:
    """Measured (median [min-max] ms, per-round ratios) against predicted forms and ratios."""
    names = " | ".join(f"predicted: {READING_NAMES[r]}" for r in model.READINGS)
    lines = [f"| form | measured (ms) | {names} |", "|---|---|" + "---|" * len(model.READINGS)]
    for form in ("independent", "chained", "unchunked"):
        spread = Spread.of([ms / 1e3 for ms in control[form]])
        guesses = " | ".join(_ms(predicted[form][r]["step_s"]) for r in model.READINGS)
        lines.append(f"| {form} | {spread.format()} | {guesses} |")
    lines += ["", f"| ratio | measured, per round | {names} |"]
    lines.append("|---|---|" + "---|" * len(model.READINGS))
    for form in ("chained", "unchunked"):
        measured = Spread.of(round_ratios(control[form], control["independent"]))
        guesses = " | ".join(
            f"{predicted[form][r]['step_s'] / predicted['independent'][r]['step_s']:.3f}"
            for r in model.READINGS
        )
        lines.append(f"| {form} / independent | {measured.format(1, 3)} | {guesses} |")
    return lines


def schedule_table(
    measured: dict,
    predicted: dict,
    readings: tuple[str, ...] = model.READINGS,
    names: dict[str, str] = READING_NAMES,
) -> list[str]:
    """Per schedule: the measured step and speedup over the first schedule (``none``),
    and per reading the predicted step, its error and the predicted speedup over it."""
    header = "".join(f" {names[r]} (ms) | error | speedup |" for r in readings)
    baseline = measured["schedules"][0]["schedule"]
    lines = [
        f"| schedule | measured step (ms) | measured speedup vs {baseline}, per round |{header}",
        "|---|---|---|" + "---|---|---|" * len(readings),
    ]
    for row in measured["schedules"]:
        step = Spread(row["step_s"], row["step_min_s"], row["step_max_s"])
        speedup = Spread(row["speedup"], row["speedup_min"], row["speedup_max"])
        cells = [row["schedule"], step.format(), speedup.format(1, 3)]
        for reading in readings:
            seconds = predicted[row["schedule"]][reading]["step_s"]
            first = predicted[baseline][reading]["step_s"]
            cells += [_ms(seconds), f"{seconds / row['step_s'] - 1:+.1%}", f"{first / seconds:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def breakdown_table(predicted: dict) -> list[str]:
    """The instrument reading's compute, communication and exposed communication."""
    lines = [
        "| schedule | compute (ms) | all-to-alls (ms) | other collectives (ms) | exposed (ms) "
        "| compute, scaled (ms) | exposed, scaled (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule, guess in predicted.items():
        plain, scaled = guess["instrument"], guess["scaled"]
        cells = [plain["compute_s"], guess["all_to_all_s"], guess["other_collectives_s"]]
        cells += [plain["exposed_s"], scaled["compute_s"], scaled["exposed_s"]]
        lines.append(f"| {schedule} | " + " | ".join(_ms(c) for c in cells) + " |")
    return lines


def worst_error(measured: dict, predicted: dict, reading: str = "instrument") -> float:
    return max(
        abs(predicted[row["schedule"]][reading]["step_s"] / row["step_s"] - 1)
        for row in measured["schedules"]
    )


def compute_only(measured: dict, source: Path | None) -> float:
    """The measured step of ``none`` on the unshaped link: from the run, or from ``source``
    (a run of the same step on another link) where the run skipped the unshaped link."""
    for report in (measured, *([json.loads(source.read_text())] if source else [])):
        none = next(row for row in report["schedules"] if row["schedule"] == "none")
        if math.isfinite(none["compute_only_s"]):
            return none["compute_only_s"]
    raise ValueError("no compute-only step of none: pass --compute-only-from a full run")


@dataclass(frozen=True)
class Validation:
    """One validation: the cluster run (as saved), the predictions, and the cluster run's
    command (its files named as in the saved directory)."""

    measured: dict
    predicted: dict
    command: str

    def section(self) -> list[str]:
        """The results file's section of this run."""
        measured, predicted = self.measured, self.predicted
        schedules = predicted["schedules"]
        return [
            f"## {measured['link_mbit']:g} Mbit/s",
            "",
            f"Cluster run: `{self.command}`",
            "",
            regime.summary(measured),
            "",
            "### The control",
            "",
            *control_table(measured["overlap_control"], predicted["control"]),
            "",
            "### The schedules",
            "",
            f"Compute scale of the `scaled` reading: {predicted['compute_scale']:.3f} (the "
            "measured compute-only step of `none` over its predicted compute).",
            "",
            *schedule_table(measured, schedules),
            "",
            *breakdown_table(schedules),
            "",
            *(
                f"Largest error, {READING_NAMES[r]}: {worst_error(measured, schedules, r):.1%} "
                f"(target {TOLERANCE:.0%})."
                for r in ("instrument", "scaled")
            ),
            "",
            *_planning_lines(schedules),
            "",
        ]


def validate(
    schedules: tuple[str, ...] = regime.SCHEDULES,
    *,
    link_mbit: float = regime.LINK_MBIT,
    quick: bool = False,
    shaped_only: bool = False,
    compute_only_from: Path | None = None,
    source: Path | None = None,
    keep: Path | None = None,
) -> Validation:
    """Measure the schedules on the cluster (saved in ``keep`` when given) or read the run
    saved in ``source``, then predict them and the control.

    Raises:
        LinkNotCalibrated, HostRunFailed: the cluster run could not be made.
    """
    with tempfile.TemporaryDirectory() as tmp:
        saved = source or keep or Path(tmp)
        saved.mkdir(parents=True, exist_ok=True)
        measured_path = saved / f"cluster-{regime.PRESET}.json"
        curves_path = saved / f"curves-{regime.PRESET}.json"
        if source is None:
            request = regime.request(
                link_mbit=link_mbit,
                quick=quick,
                shaped_only=shaped_only,
                schedules=schedules,
                sweep=curves_path,
            )
            # The command as the saved directory names its files.
            shown = replace(request, sweep=Path(curves_path.name)).command(measured_path.name)
            measurement = measure_schedules(request, shown)
            measured_path.write_text(json.dumps(measurement.to_json(), indent=2) + "\n")
        measured = json.loads(measured_path.read_text())
        compute = compute_only(measured, compute_only_from)
        devices = regime.HOSTS * regime.DEVICES_PER_HOST
        predicted = call_with_devices(
            devices, predict, str(measured_path), str(curves_path), str(OP_COSTS), compute
        )
    command = measured["command"].replace(str(measured_path), measured_path.name)
    return Validation(measured, predicted, command.replace(str(curves_path), curves_path.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--link-mbit", type=float, default=regime.LINK_MBIT)
    parser.add_argument(
        "--schedules",
        default=",".join(regime.SCHEDULES),
        help="cluster entries (NAME or NAME:N), the first the baseline of the speedups",
    )
    parser.add_argument(
        "--shaped-only",
        action="store_true",
        help="no runs on the unshaped link (then --compute-only-from gives compute-only)",
    )
    parser.add_argument(
        "--compute-only-from",
        type=Path,
        help="a cluster JSON of the same step with compute-only figures (another link)",
    )
    parser.add_argument("--from", dest="source", type=Path, help="a saved run's directory")
    parser.add_argument("--keep", type=Path, help="save the run's measurements here")
    parser.add_argument("--out", type=Path, default=RESULTS / "simulator_validation.md")
    parser.add_argument("--save-predicted", type=Path, help="also write the predictions here")
    args = parser.parse_args(argv)
    if args.source is not None and not args.source.is_dir():
        parser.error(f"--from {args.source}: no such directory")
    try:
        validation = validate(
            tuple(s for s in args.schedules.split(",") if s),
            link_mbit=args.link_mbit,
            quick=args.quick,
            shaped_only=args.shaped_only,
            compute_only_from=args.compute_only_from,
            source=args.source,
            keep=args.keep,
        )
    except LinkNotCalibrated:
        return 2
    if args.save_predicted is not None:
        args.save_predicted.write_text(json.dumps(validation.predicted))
    sections = validation.section()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sections))
    print("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
