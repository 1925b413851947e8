"""Emulated cluster: real training steps across hosts joined by a slow, shaped link.

    sudo python -m experiments.cluster --hosts 2 --devices-per-host 4 --link-mbit 300 \\
        --preset tiny --repeats 10 --schedules none,dw --json out.json [jaxmoe train overrides]
    sudo python -m experiments.cluster --calibrate --hosts 2 --devices-per-host 1 \\
        --link-mbit 200 [--json out.json]

Each host is a network namespace (``experiments.emulation.network``) running one process
with ``--devices-per-host`` fake CPU devices; all-to-alls within a host are memory copies,
across hosts they cross the shaped link (the two levels of NVLink inside a node and the
network between nodes). Every schedule's step is compiled once per host process and the
schedules run in interleaved rounds, one training step each, the order reversed every
round (``experiments.emulation.step_rounds``); ``--repeats`` is the number of timed
rounds. For each schedule it reports, side by side in one run, median [min-max] over the
rounds:

- ``step``: the real train step on the shaped link, and its speedup over the first
  schedule, round by round (each round's two steps ran next to each other);
- ``compute-only``: the same step on the same hosts with the link left
  unshaped (veth at memory speed), i.e. communication made (nearly) free;
- ``communication-only``: the step's collectives alone, same primitives and
  sizes, on the shaped link (``experiments.emulation.collectives_only``); also measured
  on the free link, which shows how little the free link still costs;
- ``exposed communication`` = step - compute-only: the communication that the
  step does not hide behind computation.

Before any of it, the shaped link is calibrated (``experiments.emulation.link_calibration``):
a large message must reach 90% of the rate and the same bytes in 8 pieces must take
within 5% of it, or the run is refused (``--allow-uncalibrated`` runs it under a loud
warning). ``--calibrate`` only calibrates (and checks nothing of the training layout). The
calibration is recorded in every results file. Then the overlap control
(``experiments.emulation.overlap_control``) runs on the same hosts and link, and its result
is printed beside the schedules and recorded with them: a schedule's gain is overlap only
where the control shows overlap (``--no-control`` skips it). ``--sweep FILE`` also runs
``jaxmoe link-curves`` on the shaped link and writes the curves that
``--schedule.link_curves`` reads. ``--traces DIR`` also traces each schedule's step with
``jax.profiler`` after its timed rounds (``DIR/shaped/<schedule>``, and ``DIR/free/...``
on the unshaped link), with the compiled module's text beside each. The measurement is
``experiments.emulation.schedule_runs.measure_schedules``. Everything it creates is
removed on exit, on errors and on Ctrl-C. Without the rights to create network
namespaces it refuses with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.emulation.hosts import machine
from experiments.emulation.link_calibration import LinkNotCalibrated, calibrate_hosts
from experiments.emulation.network import LinkShape, namespaces_available
from experiments.emulation.schedule_runs import ScheduleRequest, format_table, measure_schedules
from experiments.shared.results_file import command_line
from jaxmoe.config import ConfigError

PROG = "experiments.cluster"


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    default = ScheduleRequest()
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=default.hosts)
    parser.add_argument("--devices-per-host", type=int, default=default.devices_per_host)
    parser.add_argument("--link-mbit", type=float, default=default.link_mbit)
    parser.add_argument("--delay-ms", type=float, default=default.delay_ms)
    parser.add_argument("--preset", default=default.preset)
    parser.add_argument(
        "--repeats",
        type=int,
        default=default.repeats,
        help="timed rounds: training steps of every schedule, interleaved (and the "
        "communication-only replays)",
    )
    parser.add_argument("--warmup", type=int, default=default.warmup, help="untimed rounds first")
    parser.add_argument(
        "--schedules",
        default=",".join(default.schedules),
        help="comma-separated, e.g. none,dw; NAME:N sets the chunk count or pipelining "
        "degree, e.g. expert_pipeline:4",
    )
    parser.add_argument(
        "--schedule", help="one schedule (the same flag as jaxmoe train; adds to --schedules)"
    )
    parser.add_argument(
        "--shaped-only",
        action="store_true",
        help="skip the runs on the unshaped link (no compute-only, no exposed communication)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--no-control",
        action="store_true",
        help="skip the overlap control (experiments.emulation.overlap_control) before the "
        "schedules",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="only calibrate the shaped link (exit status 1 when it fails its criteria)",
    )
    parser.add_argument(
        "--allow-uncalibrated",
        action="store_true",
        help="run on a link that fails calibration (warned, and recorded in the results)",
    )
    parser.add_argument(
        "--sweep",
        type=Path,
        help="also time collectives on the shaped link (jaxmoe link-curves) and write the "
        "fitted curves here",
    )
    parser.add_argument(
        "--traces",
        type=Path,
        help="also trace each schedule's step (jax.profiler) after its rounds, under this "
        "directory",
    )
    return parser.parse_known_args(argv)


def request_from(args: argparse.Namespace, overrides: list[str]) -> ScheduleRequest:
    schedules = [s for s in args.schedules.split(",") if s]
    if args.schedule and args.schedule not in schedules:
        schedules.append(args.schedule)
    return ScheduleRequest(
        schedules=tuple(schedules),
        preset=args.preset,
        overrides=tuple(overrides),
        hosts=args.hosts,
        devices_per_host=args.devices_per_host,
        link_mbit=args.link_mbit,
        delay_ms=args.delay_ms,
        repeats=args.repeats,
        warmup=args.warmup,
        shaped_only=args.shaped_only,
        control=not args.no_control,
        allow_uncalibrated=args.allow_uncalibrated,
        sweep=None if args.sweep is None else args.sweep.resolve(),
        traces=None if args.traces is None else args.traces.resolve(),
    )


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(argv)
    command = command_line(PROG, sys.argv[1:] if argv is None else argv)
    if args.calibrate:  # the link alone: no training configuration to check
        if overrides:
            print(f"{PROG}: --calibrate ignores {' '.join(overrides)}", file=sys.stderr)
        try:
            link = LinkShape(rate_mbit=args.link_mbit, delay_ms=args.delay_ms)
        except ValueError as error:
            return _error(str(error))
        return _calibrate_only(args, link, command)
    request = request_from(args, overrides)
    try:
        request.check()
    except (ConfigError, ValueError) as error:
        return _error(str(error))
    available, reason = namespaces_available()
    if not available:
        print(f"{PROG}: cannot create network namespaces: {reason}", file=sys.stderr)
        return 2
    try:
        measurement = measure_schedules(request, command)
    except LinkNotCalibrated:
        return 3
    report = measurement.to_json()
    print(format_table(report))
    if measurement.control is not None:  # beside the schedules: overlap only if it shows here
        print("\n" + measurement.control.summary())
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _calibrate_only(args: argparse.Namespace, link: LinkShape, command: str) -> int:
    available, reason = namespaces_available()
    if not available:
        print(f"{PROG}: cannot create network namespaces: {reason}", file=sys.stderr)
        return 2
    calibration = calibrate_hosts(args.hosts, link)
    print(calibration.summary())
    if args.json is not None:
        report = {"command": command, "machine": machine(), **calibration.to_dict()}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if calibration.passed else 1


if __name__ == "__main__":
    sys.exit(main())
