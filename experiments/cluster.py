"""Emulated cluster: real training steps across hosts joined by a slow, shaped link.

    sudo python -m experiments.cluster --hosts 2 --devices-per-host 4 --link-mbit 300 \\
        --preset tiny --steps 20 --schedules none,dw --json out.json [jaxmoe train overrides]

Each host is a network namespace (``experiments.netns``) running one process
with ``--devices-per-host`` fake CPU devices; all-to-alls within a host are
memory copies, across hosts they cross the shaped link (the two levels of
NVLink inside a node and the network between nodes). For each schedule it
measures, side by side in one run:

- ``step``: the median step time of the real train step on the shaped link;
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
file. Everything it creates is removed on exit, on errors and on Ctrl-C. Without the
rights to create network namespaces it refuses with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.link_calibration import LinkCalibration, calibrate_link, ensure_calibrated
from experiments.netns import EmulatedNetwork, LinkShape, namespaces_available
from jaxmoe.config import SCHEDULES, ConfigError
from jaxmoe.train.cli import config_from_train_args
from jaxmoe.train.launch import launch


@dataclass
class ScheduleResult:
    schedule: str
    step_s: float
    compute_only_s: float
    exposed_communication_s: float
    tokens_per_s: float


def _median_step(run_dir: Path, warmup: int) -> tuple[float, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = rows[warmup:] or rows
    step = statistics.median(row["step_time_s"] for row in timed)
    return step, statistics.median(row["tokens_per_s"] for row in timed)


class Cluster:
    """Runs commands as one process per emulated host; logs go to ``workdir``."""

    def __init__(self, network: EmulatedNetwork, workdir: Path, name: str):
        self.network = network
        self.workdir = workdir
        self.name = name

    def run(self, label: str, command_args: list[str], module: str = "jaxmoe.train.cli") -> None:
        log_path = self.workdir / f"{self.name}-{label}.log"
        with log_path.open("w") as log:
            status = launch(
                command_args,
                len(self.network.namespaces),
                coordinator_host=self.network.host_addresses[0],
                port=20000 + secrets.randbelow(20000),
                wrap=self.network.command,
                output=log,
                module=module,
            )
        if status != 0:
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
            raise RuntimeError(f"{label} on the {self.name} link failed; its log ends:\n{tail}")

    def train(self, train_args: list[str], schedule: str, steps: int, warmup: int):
        out = self.workdir / f"{self.name}-train-{schedule.replace(':', '-')}"
        args = ["train", *train_args, "--steps", str(steps), *schedule_flags(schedule)]
        args += ["--no-progress", "--out", str(out)]
        self.run(f"train-{schedule.replace(':', '-')}", args)
        return _median_step(out, warmup)

    def sweep(self, config, args: argparse.Namespace, out: Path) -> None:
        source = (
            f"emulated cluster: {args.hosts} hosts x {args.devices_per_host} devices, "
            f"{args.link_mbit:g} Mbit/s, {args.delay_ms:g} ms"
        )
        command = ["--parallel-data", str(config.parallel.data)]
        command += ["--parallel-expert", str(config.parallel.expert)]
        command += ["--out", str(out), "--source", source]
        self.run("collective-sweep", command, module="experiments.collective_sweep")

    def collectives_only(self, config_path: Path, repeats: int) -> float:
        out = self.workdir / f"{self.name}-collectives.json"
        args = ["--config", str(config_path), "--json", str(out), "--repeats", str(repeats)]
        self.run("collectives-only", args, module="experiments.collectives_only")
        return json.loads(out.read_text())["median_s"]


def schedule_flags(schedule: str) -> list[str]:
    """``jaxmoe train`` flags for a schedule entry: ``NAME`` or ``NAME:N`` (N chunks)."""
    name, _, chunks = schedule.partition(":")
    flags = ["--schedule", name]
    if chunks:
        flags += ["--train.schedule_partition_chunks", chunks]
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
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument(
        "--schedules",
        default="none",
        help="comma-separated, e.g. none,dw; NAME:N sets the chunk count or pipelining "
        "degree, e.g. expert_pipeline:4",
    )
    parser.add_argument(
        "--schedule", help="one schedule (the same flag as jaxmoe train; adds to --schedules)"
    )
    parser.add_argument("--repeats", type=int, default=10, help="collectives-only repeats")
    parser.add_argument(
        "--shaped-only",
        action="store_true",
        help="skip the runs on the unshaped link (no compute-only, no exposed communication)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
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
        devices = args.hosts * args.devices_per_host
        if config.parallel.num_devices != devices:
            raise ConfigError(
                f"parallel.data x parallel.expert = {config.parallel.num_devices}, but "
                f"{args.hosts} hosts x {args.devices_per_host} devices = {devices}: "
                "pass --parallel.data/--parallel.expert to match"
            )
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

    results: dict[str, dict[str, float]] = {name: {} for name in schedules}
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
                for schedule in schedules:
                    step, tokens_per_s = cluster.train(
                        train_args, schedule, args.steps, args.warmup
                    )
                    results[schedule][f"{name}_step_s"] = step
                    results[schedule][f"{name}_tokens_per_s"] = tokens_per_s
                results[f"collectives_{name}"] = {
                    "seconds": cluster.collectives_only(config_path, args.repeats)
                }
                if name == "shaped" and args.sweep is not None:
                    cluster.sweep(config, args, args.sweep.resolve())
                    record_calibration(args.sweep, calibration, command)

    unmeasured = float("nan")  # --shaped-only: no run on the free link
    rows = []
    for s in schedules:
        step, compute_only = results[s]["shaped_step_s"], results[s].get("free_step_s", unmeasured)
        rows.append(
            ScheduleResult(
                schedule=s,
                step_s=step,
                compute_only_s=compute_only,
                exposed_communication_s=step - compute_only,
                tokens_per_s=results[s]["shaped_tokens_per_s"],
            )
        )
    communication = results["collectives_shaped"]["seconds"]
    residual = results.get("collectives_free", {}).get("seconds", unmeasured)
    report = {
        "command": command,
        "machine": machine(),
        "link_calibration": calibration.to_dict(),
        "hosts": args.hosts,
        "devices_per_host": args.devices_per_host,
        "link_mbit": args.link_mbit,
        "delay_ms": args.delay_ms,
        "preset": args.preset,
        "steps": args.steps,
        "warmup": args.warmup,
        "config": config.to_dict(),
        "communication_only_s": communication,
        "communication_only_free_link_s": residual,
        "schedules": [asdict(row) for row in rows],
    }
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def machine() -> str:
    """The host, for results files (timings depend on its cores, shared by every process)."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores"


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
    header = (
        f"{report['hosts']} hosts x {report['devices_per_host']} devices, link "
        f"{report['link_mbit']:g} Mbit/s, delay {report['delay_ms']:g} ms, preset "
        f"{report['preset']}, {report['steps']} steps (median after {report['warmup']})"
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
        "| schedule | step (ms) | compute-only (ms) | communication-only (ms) "
        "| exposed communication (ms) | exposed / communication | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    communication = report["communication_only_s"]
    for row in report["schedules"]:
        lines.append(
            f"| {row['schedule']} | {row['step_s'] * 1e3:.1f} | {row['compute_only_s'] * 1e3:.1f} "
            f"| {communication * 1e3:.1f} | {row['exposed_communication_s'] * 1e3:.1f} "
            f"| {row['exposed_communication_s'] / communication:.2f} "
            f"| {row['tokens_per_s']:,.0f} |"
        )
    residual_ms = report["communication_only_free_link_s"] * 1e3
    lines += ["", f"(communication-only on the free link: {residual_ms:.1f} ms)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
