"""Emulated cluster: real training steps across hosts joined by a slow, shaped link.

    sudo python -m experiments.cluster --hosts 2 --devices-per-host 4 --link-mbit 300 \\
        --preset tiny --repeats 10 --schedules none,dw --json out.json [jaxmoe train overrides]

Each host is a network namespace (``experiments.netns``) running one process
with ``--devices-per-host`` fake CPU devices; all-to-alls within a host are
memory copies, across hosts they cross the shaped link (the two levels of
NVLink inside a node and the network between nodes). Every schedule's step is
compiled once per host process and the schedules run in interleaved rounds, one
training step each, the order reversed every round (``experiments.step_rounds``);
``--repeats`` is the number of timed rounds. For each schedule it reports, side by
side in one run, median [min-max] over the rounds:

- ``step``: the real train step on the shaped link, and its speedup over the first
  schedule, round by round (each round's two steps ran next to each other);
- ``compute-only``: the same step on the same hosts with the link left
  unshaped (veth at memory speed), i.e. communication made (nearly) free;
- ``communication-only``: the step's collectives alone, same primitives and
  sizes, on the shaped link (``experiments.collectives_only``); also measured
  on the free link, which shows how little the free link still costs;
- ``exposed communication`` = step - compute-only: the communication that the
  step does not hide behind computation.

Before any of it, the shaped link is calibrated (``experiments.link_calibration``):
a large message must reach 90% of the rate and the same bytes in 8 pieces must take
within 5% of it, or the run is refused (``--allow-uncalibrated`` runs it under a loud
warning). ``--calibrate`` only calibrates. The calibration is recorded in every results
file. Then the overlap control (``experiments.overlap_control``) runs on the same hosts
and link, and its result is printed beside the schedules and recorded with them: a
schedule's gain is overlap only where the control shows overlap (``--no-control``
skips it). Everything it creates is removed on exit, on errors and on Ctrl-C. Without
the rights to create network namespaces it refuses with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.hosts import Cluster, check_hosts_fill_layout, machine
from experiments.link_calibration import LinkCalibration, calibrate_link, ensure_calibrated
from experiments.netns import EmulatedNetwork, LinkShape, namespaces_available
from experiments.overlap_control import cluster_control_args, run_control
from experiments.spread import Spread, round_ratios
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import ConfigError
from scheduling.names import POLICIES as SCHEDULES


@dataclass
class ScheduleResult:
    """One schedule's figures; times in seconds, ``*_rounds_s`` one entry per round."""

    schedule: str
    step_s: float  # median over rounds
    step_min_s: float
    step_max_s: float
    step_rounds_s: list[float]
    compute_only_s: float  # median over rounds on the free link
    compute_only_rounds_s: list[float]
    exposed_communication_s: float  # median step - median compute-only
    tokens_per_s: float  # at the median step
    speedup: float  # median over rounds of baseline step / this step, same round
    speedup_min: float
    speedup_max: float


def schedule_results(
    shaped: dict[str, list[float]], free: dict[str, list[float]] | None, tokens_per_step: int
) -> list[ScheduleResult]:
    """Per-schedule figures from per-round times; the first schedule is the baseline of the
    speedups (each round's baseline step over the schedule's step in the same round)."""
    baseline = next(iter(shaped.values()))
    rows = []
    for schedule, rounds in shaped.items():
        step = Spread.of(rounds)
        free_rounds = [] if free is None else free[schedule]
        compute = Spread.of(free_rounds).median if free_rounds else float("nan")
        speedup = Spread.of(round_ratios(baseline, rounds))
        rows.append(
            ScheduleResult(
                schedule=schedule,
                step_s=step.median,
                step_min_s=step.low,
                step_max_s=step.high,
                step_rounds_s=list(rounds),
                compute_only_s=compute,
                compute_only_rounds_s=list(free_rounds),
                exposed_communication_s=step.median - compute,
                tokens_per_s=tokens_per_step / step.median,
                speedup=speedup.median,
                speedup_min=speedup.low,
                speedup_max=speedup.high,
            )
        )
    return rows


def schedule_flags(schedule: str) -> list[str]:
    """``jaxmoe train`` flags for a schedule entry: ``NAME`` or ``NAME:N`` (N chunks)."""
    name, _, chunks = schedule.partition(":")
    flags = ["--schedule", name]
    if chunks:
        flags += ["--schedule.partition_chunks", chunks]
    return flags


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.cluster", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices-per-host", type=int, default=4)
    parser.add_argument("--link-mbit", type=float, default=300.0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="timed rounds: training steps of every schedule, interleaved (and the "
        "communication-only replays)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument(
        "--schedules",
        default="none",
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
        help="skip the overlap control (experiments.overlap_control) run before the schedules",
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
        help="also sweep collective sizes on the shaped link and write the fitted curves here",
    )
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    if args.schedule and args.schedule not in schedules:
        schedules.append(args.schedule)
    try:
        unknown = [s for s in schedules if s.split(":")[0] not in SCHEDULES]
        if unknown:
            raise ConfigError(f"--schedules: {unknown} not among {', '.join(SCHEDULES)}")
        train_args = ["--preset", args.preset, *overrides]
        config = config_from_train_args(train_args)
        check_hosts_fill_layout(config, args.hosts, args.devices_per_host)
        shaped_link = LinkShape(rate_mbit=args.link_mbit, delay_ms=args.delay_ms)
    except (ConfigError, ValueError) as error:
        print(f"experiments.cluster: error: {error}", file=sys.stderr)
        return 2
    available, reason = namespaces_available()
    if not available:
        print(f"experiments.cluster: cannot create network namespaces: {reason}", file=sys.stderr)
        return 2
    command = "python -m experiments.cluster " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.calibrate:
        return _calibrate_only(args, shaped_link, command)

    measured: dict[str, dict[str, list[float]]] = {}
    control = None
    communication: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="jaxmoe-cluster-") as tmp:
        workdir = Path(tmp)
        config_path = workdir / "config.json"
        config_path.write_text(json.dumps(config.to_dict()))
        links = [("shaped", shaped_link), ("free", LinkShape(rate_mbit=None))]
        for name, link in links[:1] if args.shaped_only else links:
            with EmulatedNetwork(args.hosts, link) as network:
                if name == "shaped":
                    calibration = calibrate_link(network)
                    if not ensure_calibrated(
                        calibration, allow_uncalibrated=args.allow_uncalibrated
                    ):
                        return 3
                cluster = Cluster(network, workdir, name)
                if name == "shaped" and not args.no_control:
                    control = run_control(
                        cluster,
                        cluster_control_args(
                            args.devices_per_host,
                            args.hosts,
                            args.link_mbit,
                            args.repeats,
                            args.warmup,
                        ),
                    )
                    print(control.summary(), flush=True)
                measured[name] = cluster.step_rounds(
                    config_path, schedules, args.repeats, args.warmup
                )
                communication[name] = cluster.collectives_only(config_path, args.repeats)
                if name == "shaped" and args.sweep is not None:
                    cluster.sweep(config, args, args.sweep.resolve())
                    record_calibration(args.sweep, calibration, command)

    tokens_per_step = config.train.batch_size * config.model.seq_len
    rows = schedule_results(measured["shaped"], measured.get("free"), tokens_per_step)
    report = {
        "command": command,
        "machine": machine(),
        "link_calibration": calibration.to_dict(),
        "hosts": args.hosts,
        "devices_per_host": args.devices_per_host,
        "link_mbit": args.link_mbit,
        "delay_ms": args.delay_ms,
        "preset": args.preset,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "round_order": "listed order in even rounds, reversed in odd rounds",
        "config": config.to_dict(),
        "communication_only_s": communication["shaped"],
        "communication_only_free_link_s": communication.get("free", float("nan")),
        "schedules": [asdict(row) for row in rows],
        "overlap_control": None if control is None else control.to_json(),
    }
    print(format_table(report))
    if control is not None:  # beside the schedules: overlap is claimed only if it shows here
        print("\n" + control.summary())
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def record_calibration(path: Path, calibration: LinkCalibration, command: str) -> None:
    """Add the link's calibration (and the command) to a JSON results file written by another
    module on this cluster."""
    data = json.loads(path.read_text())
    data["link_calibration"] = calibration.to_dict()
    data.setdefault("command", command)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _calibrate_only(args: argparse.Namespace, link: LinkShape, command: str) -> int:
    with EmulatedNetwork(max(args.hosts, 2), link) as network:
        calibration = calibrate_link(network)
    print(calibration.summary())
    if args.json is not None:
        report = {"command": command, "machine": machine(), **calibration.to_dict()}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if calibration.passed else 1


def format_table(report: dict) -> str:
    """The results as a Markdown table: median [min-max] over rounds, and per-round speedups
    over the first schedule."""
    baseline = report["schedules"][0]["schedule"]
    header = (
        f"{report['hosts']} hosts x {report['devices_per_host']} devices, link "
        f"{report['link_mbit']:g} Mbit/s, delay {report['delay_ms']:g} ms, preset "
        f"{report['preset']}; {report['repeats']} interleaved rounds after "
        f"{report['warmup']} untimed, median [min-max]; {report['machine']}"
    )
    calibration = report.get("link_calibration")
    if calibration is not None:
        verdict = "calibrated" if calibration["passed"] else "NOT CALIBRATED"
        header += (
            f"\nlink {verdict}: a large message at {calibration['rate_fraction']:.1%} of the "
            f"rate, {calibration['pieces']} pieces {calibration['pieces_ratio']:.3f}x one message"
        )
    lines = [
        header,
        "",
        f"| schedule | step (ms) | speedup vs {baseline} (per round) | compute-only (ms) "
        "| communication-only (ms) | exposed communication (ms) | exposed / communication "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    communication = report["communication_only_s"]
    for row in report["schedules"]:
        step = Spread(row["step_s"], row["step_min_s"], row["step_max_s"])
        speedup = Spread(row["speedup"], row["speedup_min"], row["speedup_max"])
        lines.append(
            f"| {row['schedule']} | {step.format()} | {speedup.format(1, 3)} "
            f"| {row['compute_only_s'] * 1e3:.1f} "
            f"| {communication * 1e3:.1f} | {row['exposed_communication_s'] * 1e3:.1f} "
            f"| {row['exposed_communication_s'] / communication:.2f} "
            f"| {row['tokens_per_s']:,.0f} |"
        )
    residual_ms = report["communication_only_free_link_s"] * 1e3
    lines += ["", f"(communication-only on the free link: {residual_ms:.1f} ms)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
