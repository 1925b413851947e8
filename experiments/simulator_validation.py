"""The simulator against the emulated cluster: first the overlap control, then the schedules.

    sudo python -m experiments.simulator_validation [--quick] [--keep DIR | --from DIR]

One emulated-cluster run (``experiments.cluster``) measures the instrument in the regime
of ``experiments.overlap_regime`` (2 hosts x 1 device, a calibrated 50 Mbit/s link,
``tiny`` with top-2 and 128 sequences, every all-to-all over the socket transport), with
the overlap control beside the schedules, the step on the unshaped link (compute-only),
and a sweep of the link's collective costs. Then the simulator predicts, from a
description of that instrument that is measured, not fitted to steps:

- ops: each distinct op timed on both devices at once in one process (the two host
  processes share the machine's cores; ``scheduling.profiling``); layout ops are free,
  elementwise ops cost their memory traffic (XLA fuses them);
- collectives: an all-to-all (socket transport, one device per host) sends half its
  operand across the link, so it costs what the link calibration's size sweep measured
  for that many bytes; the gradient reductions (XLA's, over gloo) cost what the sweep of
  ``experiments.collective_sweep`` measured;
- overlap: the two-stream simulator (``scheduling.simulate``), read three ways. The
  instrument: split all-to-alls overlap (the socket pairs do), every other collective runs
  where its start stands (XLA:CPU runs its own pairs synchronously). All asynchronous:
  every split collective overlaps (a GPU-like backend). In place: nothing overlaps.

The control comes first: its three forms (``experiments.overlap_control``, with
``lax.all_to_all`` so that the simulator sees the exchanges, planned by ``async``) are
predicted and set against the measured per-round ratios. Then each schedule, planned as
the run planned it. Writes ``experiments/results/simulator_validation.md``; ``--keep DIR``
saves the run's measurements (``cluster-tiny.json``, ``curves-tiny.json``), ``--from DIR``
predicts again from them without the cluster.
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

from experiments import overlap_regime as regime
from experiments.spread import Spread, round_ratios

RESULTS = Path(__file__).parent / "results"
TOLERANCE = 0.15
READINGS = ("instrument", "all_async", "in_place")


def socket_all_to_all_samples(sweep: list[dict], group: int) -> list[tuple[float, float]]:
    """``(operand bytes, seconds)`` of an all-to-all over ``group`` hosts of one device each,
    from the link calibration's sweep: of its operand, ``(group - 1) / group`` leaves the
    host over its one shaped link (each direction shaped on its own)."""
    return [(point["bytes"] * group / (group - 1), point["seconds"]) for point in sweep]


def instrument_cost(mesh, curves_path: Path, calibration: dict, cache: Path):
    """The cost model describing the cluster, from its measurements."""
    from scheduling.cost import PROFILES
    from scheduling.link_model import CollectiveCurves, PiecewiseLinear
    from scheduling.profiling import OpProfiler, ProfiledCostModel

    instrument = replace(PROFILES["cpu"], name="emulated cluster", fused_elementwise=True)
    curves = CollectiveCurves.load(curves_path)
    group = mesh.devices.size
    samples = socket_all_to_all_samples(calibration["sweep"], group)
    curves.curves[("all_to_all", group)] = PiecewiseLinear.fit(samples)
    profiler = OpProfiler(cache, mesh=mesh)
    return ProfiledCostModel(instrument, dict(mesh.shape), profiler, curves)


def _readings(graph, order, seconds) -> dict[str, dict[str, float]]:
    from scheduling.simulate import simulate

    def sockets_overlap(node) -> bool:
        return node.op.primitive == "all_to_all"

    readings = {}
    for name, asynchronous in zip(READINGS, (sockets_overlap, True, False), strict=True):
        timeline = simulate(graph, order, seconds, asynchronous=asynchronous)
        readings[name] = {
            "step_s": timeline.step_seconds,
            "compute_s": timeline.compute_seconds,
            "communication_s": timeline.communication_seconds,
            "exposed_s": timeline.exposed_communication_seconds,
        }
    return readings


def predict_control(settings: dict, cost) -> dict[str, dict[str, dict[str, float]]]:
    """The control's three forms, simulated; each planned by ``async`` on the instrument."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from experiments.overlap_control import per_device_forms
    from scheduling.capture import capture
    from scheduling.optimize import node_seconds, plan
    from scheduling.policy import SchedulePolicy

    axis = "devices"
    mesh = jax.make_mesh((jax.device_count(),), (axis,))
    args = argparse.Namespace(**{k: settings[k] for k in ("rows", "width", "layers", "chunks")})
    specs = (PartitionSpec(axis), PartitionSpec())
    x = jax.ShapeDtypeStruct(
        (args.rows * mesh.devices.size, args.width),
        "float32",
        sharding=NamedSharding(mesh, specs[0]),
    )
    w = jax.ShapeDtypeStruct(
        (args.width, args.width), "float32", sharding=NamedSharding(mesh, specs[1])
    )
    policy = SchedulePolicy(name="async", profile=cost.profile)
    predicted = {}
    for form, body in per_device_forms(axis, args).items():
        program = capture(body, x, w, mesh=mesh, in_specs=specs, out_specs=specs[0])
        planned = plan(program, policy, cost)
        seconds = node_seconds(cost)
        predicted[form] = _readings(planned.graph, planned.schedule.order, seconds)
        print(f"  control {form}: {predicted[form]['instrument']['step_s'] * 1e3:.1f} ms predicted")
    return predicted


def predict_schedules(cost) -> dict[str, dict[str, dict[str, float]]]:
    """Each schedule's step, planned as the run planned it, simulated on the instrument."""
    from experiments.cluster import schedule_flags
    from jaxmoe.parallel import build_mesh
    from jaxmoe.train.cli import config_from_train_args
    from jaxmoe.train.scheduled import capture_train_step, schedule_policy
    from scheduling.optimize import batch_inputs, cost_model, node_seconds, plan

    argv = ["--preset", regime.PRESET, *regime.REGIME]
    config = config_from_train_args(argv)
    mesh = build_mesh(config.parallel)
    # The schedule fields do not change the step: one capture serves every schedule.
    program, sharded = capture_train_step(config, mesh)
    batch = batch_inputs(program, sharded.batch_argnums)
    predictions = {}
    for schedule in regime.SCHEDULES:
        policy = schedule_policy(config_from_train_args([*argv, *schedule_flags(schedule)]))
        planned = plan(program, policy, cost_model(policy, mesh), batch)
        seconds = node_seconds(cost)  # memoised per node id: one per graph
        predictions[schedule] = _readings(planned.graph, planned.schedule.order, seconds)
        step = predictions[schedule]["instrument"]["step_s"]
        print(f"  {schedule}: {step * 1e3:.1f} ms predicted")
    return predictions


def predict(measured_path: Path, curves_path: Path, cache: Path) -> dict:
    """Runs in a process with the cluster's devices (one per host)."""
    from jaxmoe.parallel import build_mesh
    from jaxmoe.train.cli import config_from_train_args

    measured = json.loads(measured_path.read_text())
    mesh = build_mesh(config_from_train_args(["--preset", regime.PRESET, *regime.REGIME]).parallel)
    cost = instrument_cost(mesh, curves_path, measured["link_calibration"], cache)
    control = measured["overlap_control"]
    settings = {"rows": control["rows_per_device"], **control}
    result = {"control": predict_control(settings, cost), "schedules": predict_schedules(cost)}
    cost.profiler.save()
    return result


# -- the tables -----------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def control_table(control: dict, predicted: dict) -> list[str]:
    """Measured (median [min-max] ms, per-round ratios) against predicted forms and ratios."""
    lines = [
        "| form | measured (ms) | predicted: instrument (ms) | predicted: all asynchronous "
        "(ms) | predicted: in place (ms) |",
        "|---|---|---|---|---|",
    ]
    for form in ("independent", "chained", "unchunked"):
        spread = Spread.of([ms / 1e3 for ms in control[form]])
        guesses = " | ".join(_ms(predicted[form][r]["step_s"]) for r in READINGS)
        lines.append(f"| {form} | {spread.format()} | {guesses} |")
    lines += [
        "",
        "| ratio | measured, per round | predicted: instrument | predicted: all asynchronous "
        "| predicted: in place |",
        "|---|---|---|---|---|",
    ]
    for form in ("chained", "unchunked"):
        measured = Spread.of(round_ratios(control[form], control["independent"]))
        guesses = " | ".join(
            f"{predicted[form][r]['step_s'] / predicted['independent'][r]['step_s']:.3f}"
            for r in READINGS
        )
        lines.append(f"| {form} / independent | {measured.format(1, 3)} | {guesses} |")
    return lines


def schedule_table(measured: dict, predicted: dict) -> list[str]:
    """Per schedule: measured median step and speedup over ``none`` against each reading."""
    lines = [
        "| schedule | measured step (ms) | measured speedup vs none, per round | predicted: "
        "instrument (ms) | error | predicted speedup vs none | predicted compute (ms) "
        "| predicted exposed (ms) | all asynchronous (ms) | error | in place (ms) | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    none = predicted["none"]["instrument"]["step_s"]
    for row in measured["schedules"]:
        guess = predicted[row["schedule"]]
        step = Spread(row["step_s"], row["step_min_s"], row["step_max_s"])
        speedup = Spread(row["speedup"], row["speedup_min"], row["speedup_max"])
        cells = [row["schedule"], step.format(), speedup.format(1, 3)]
        instrument = guess["instrument"]
        cells += [_ms(instrument["step_s"]), f"{instrument['step_s'] / row['step_s'] - 1:+.1%}"]
        cells += [f"{none / instrument['step_s']:.3f}"]
        cells += [_ms(instrument["compute_s"]), _ms(instrument["exposed_s"])]
        for reading in ("all_async", "in_place"):
            seconds = guess[reading]["step_s"]
            cells += [_ms(seconds), f"{seconds / row['step_s'] - 1:+.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def worst_error(measured: dict, predicted: dict) -> float:
    return max(
        abs(predicted[row["schedule"]]["instrument"]["step_s"] / row["step_s"] - 1)
        for row in measured["schedules"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--from", dest="source", type=Path, help="a saved run's directory")
    parser.add_argument("--keep", type=Path, help="save the run's measurements here")
    parser.add_argument("--out", type=Path, default=RESULTS / "simulator_validation.md")
    parser.add_argument("--predict", type=Path, help=argparse.SUPPRESS)  # worker: measured
    parser.add_argument("--curves", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cache = RESULTS.parent / ".op_costs"

    if args.predict:  # a process with the cluster's devices
        args.rows.write_text(json.dumps(predict(args.predict, args.curves, cache)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        saved = args.source or args.keep or Path(tmp)
        saved.mkdir(parents=True, exist_ok=True)
        measured_path = saved / f"cluster-{regime.PRESET}.json"
        curves_path = saved / f"curves-{regime.PRESET}.json"
        if args.source is None:
            from experiments import cluster

            if cluster.main(regime.cluster_argv(args.quick, measured_path, curves_path)) != 0:
                return 2
        measured = json.loads(measured_path.read_text())
        rows_path = Path(tmp) / "predicted.json"
        devices = regime.HOSTS * regime.DEVICES_PER_HOST
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        worker = [sys.executable, "-m", "experiments.simulator_validation"]
        worker += ["--predict", str(measured_path), "--curves", str(curves_path)]
        worker += ["--rows", str(rows_path)]
        subprocess.run(worker, env=env, check=True)
        predicted = json.loads(rows_path.read_text())
    shown = measured["command"].replace(str(measured_path), measured_path.name)
    shown = shown.replace(str(curves_path), curves_path.name)
    worst = worst_error(measured, predicted["schedules"])
    verdict = "within" if worst <= TOLERANCE else "outside"
    sections = [
        "# Simulator validation",
        "",
        "Command: `python -m experiments.simulator_validation"
        + (" --quick`" if args.quick else "`")
        + f"; the cluster run it makes: `{shown}`",
        "",
        regime.summary(measured),
        "",
        "## The control",
        "",
        *control_table(measured["overlap_control"], predicted["control"]),
        "",
        "## The schedules",
        "",
        *schedule_table(measured, predicted["schedules"]),
        "",
        f"Largest error of the instrument reading: {worst:.1%}, {verdict} the "
        f"{TOLERANCE:.0%} target.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sections))
    print("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
