"""Expert placement on the emulated cluster: step times of no replicas, static and dynamic.

    sudo python -m experiments.placement_cluster [--hosts 2 --devices-per-host 4]
        [--link-mbit 50] [--repeats 6 --warmup 2] [--shaped-only] [--json OUT.json]
        [--out experiments/results/placement_cluster.md] [jaxmoe train overrides]
    python -m experiments.placement_cluster --from RUN.json  # the results file again

The issue's step-time comparison of ``experiments.placement_eval``, on real steps across
processes: each host is a network namespace running one process, the hosts joined by a
calibrated shaped link (``experiments.cluster``'s instrument: the run is refused unless
the link passes calibration, ``--allow-uncalibrated`` aside). On every host
``experiments.emulation.placement_rounds`` runs the three variants (no replicas, static, dynamic) in
interleaved rounds at equal per-device buffers; the same rounds run again on the unshaped
link (compute-only) unless ``--shaped-only``. Defaults: ``tiny`` with 2 replica slots per
device and re-planning after every step, as ``placement_eval`` trains it, on 2 hosts x 4
devices (expert parallel 8: half of every all-to-all crosses the link).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from experiments.emulation.hosts import EmulatedHosts, check_hosts_fill_layout, machine
from experiments.emulation.link_calibration import LinkNotCalibrated, calibrated_network
from experiments.emulation.network import EmulatedNetwork, LinkShape, namespaces_available
from experiments.emulation.placement_rounds import (
    VARIANTS,
    run_placement_rounds,
    variant_configs,
)
from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import ConfigError

RESULTS = Path(__file__).parent / "results"
DEFAULT_OVERRIDES = ("--moe.slots_per_device", "2", "--moe.rebalance_every", "1")


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.placement_cluster", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices-per-host", type=int, default=4)
    parser.add_argument("--link-mbit", type=float, default=50.0)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=6, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--shaped-only", action="store_true", help="no unshaped-link rounds")
    parser.add_argument("--allow-uncalibrated", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--out", type=Path, default=RESULTS / "placement_cluster.md")
    parser.add_argument(
        "--from",
        dest="source",
        type=Path,
        help="write the results file from this saved run (--json) instead of running",
    )
    return parser.parse_known_args(argv)


def _check(args: argparse.Namespace, overrides: list[str]):
    """The run's config, checked (with the hosts and the output) before anything starts."""
    config = config_from_train_args(["--preset", args.preset, *DEFAULT_OVERRIDES, *overrides])
    variant_configs(config)
    check_hosts_fill_layout(config, args.hosts, args.devices_per_host)
    LinkShape(rate_mbit=args.link_mbit)  # raises ValueError for a bad rate
    if args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--repeats must be at least 1 and --warmup at least 0")
    for path in (args.out, args.json):
        if path is not None and not path.parent.is_dir():
            raise ConfigError(f"{path}: its directory {path.parent} does not exist")
    return config


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(argv)
    if args.source is not None:
        text = "\n".join(report_lines(json.loads(args.source.read_text())))
        args.out.write_text(text + "\n")
        print(text)
        return 0
    try:
        config = _check(args, overrides)
    except (ConfigError, ValueError) as error:
        print(f"experiments.placement_cluster: error: {error}", file=sys.stderr)
        return 2
    available, reason = namespaces_available()
    if not available:
        print(f"experiments.placement_cluster: no network namespaces: {reason}", file=sys.stderr)
        return 2
    command = command_line("experiments.placement_cluster", sys.argv[1:] if argv is None else argv)
    measured: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="jaxmoe-placement-") as tmp:
        workdir = Path(tmp)
        try:
            with calibrated_network(
                args.hosts,
                LinkShape(rate_mbit=args.link_mbit),
                allow_uncalibrated=args.allow_uncalibrated,
            ) as (network, calibration):
                shaped = EmulatedHosts(network, workdir, "shaped")
                measured["shaped"] = _rounds(shaped, config, args)
        except LinkNotCalibrated:
            return 3
        if not args.shaped_only:
            with EmulatedNetwork(args.hosts, LinkShape(rate_mbit=None)) as network:
                measured["free"] = _rounds(EmulatedHosts(network, workdir, "free"), config, args)
    report = {
        "command": command,
        "machine": machine(),
        "link_calibration": calibration.to_dict(),
        "hosts": args.hosts,
        "devices_per_host": args.devices_per_host,
        "link_mbit": args.link_mbit,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "config": config.to_dict(),
        "measured": measured,
    }
    text = "\n".join(report_lines(report))
    print(text)
    args.out.write_text(text + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _rounds(hosts: EmulatedHosts, config, args: argparse.Namespace) -> dict:
    config_path = hosts.write_config(config)
    return run_placement_rounds(hosts, config_path, args.repeats, args.warmup).to_json()


def report_lines(report: dict) -> list[str]:
    """The results file: the run, the link's calibration, and one row per variant."""
    shaped, free = report["measured"]["shaped"], report["measured"].get("free")
    calibration = report["link_calibration"]
    config = report["config"]
    moe, parallel = config["moe"], config["parallel"]
    lines = [
        "# Expert placement on the emulated cluster: step time at equal buffers",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{report['hosts']} hosts x {report['devices_per_host']} devices (data "
        f"{parallel['data']} x expert {parallel['expert']}), {report['link_mbit']:g} Mbit/s "
        f"link, {config['model']['num_layers']} layers, {moe['num_experts']} experts, top-"
        f"{moe['top_k']}, capacity factor {moe['capacity_factor']}, "
        f"{moe['slots_per_device']} slots per device for static and dynamic (re-planned every "
        f"{moe['rebalance_every']} steps), {config['train']['batch_size']} sequences of "
        f"{config['model']['seq_len']}. {report['repeats']} interleaved rounds after "
        f"{report['warmup']} untimed, the order reversed every other round; median "
        f"[min-max] over rounds, ratios per round. Machine: {report['machine']}.",
        "",
        f"Link {'calibrated' if calibration['passed'] else 'NOT CALIBRATED'}: a "
        f"{calibration['message_bytes'] / 2**20:.2f} MiB message at "
        f"{calibration['rate_fraction']:.1%} of the rate, {calibration['pieces']} pieces "
        f"{calibration['pieces_ratio']:.3f}x one message.",
        "",
        "| variant | step (ms) | / no replicas, per round | / static, per round "
        "| compute-only (ms) | dropped fraction (median) |",
        "|---|---|---|---|---|---|",
    ]
    seconds = shaped["seconds"]
    for name in VARIANTS:
        over_none = Spread.of(round_ratios(seconds[name], seconds["no replicas"]))
        over_static = Spread.of(round_ratios(seconds[name], seconds["static"]))
        compute = "n/a" if free is None else Spread.of(free["seconds"][name]).format()
        lines.append(
            f"| {name} | {Spread.of(seconds[name]).format()} | {over_none.format(1, 3)} "
            f"| {over_static.format(1, 3)} | {compute} "
            f"| {statistics.median(shaped['dropped_fraction'][name]):.4f} |"
        )
    planning = Spread.of(shaped["planning_s"])
    lines += [
        "",
        f"Re-planning in `dynamic` (planner and table upload, inside its step time): "
        f"{planning.format()} ms per step; slots changed per re-planning, mean "
        f"{statistics.mean(shaped['changed_slots']):.1f}.",
        "",
        *reading(shaped, free),
    ]
    return lines


def reading(shaped: dict, free: dict | None) -> list[str]:
    """What the rounds say, each statement read off the figures above."""
    seconds = shaped["seconds"]
    replicas = Spread.of(round_ratios(seconds["static"], seconds["no replicas"]))
    text = (
        f"Reading. The replica slots cost {replicas.median:.2f}x the step without them on the "
        "shaped link"
    )
    if free is not None:
        unshaped = Spread.of(
            round_ratios(free["seconds"]["static"], free["seconds"]["no replicas"])
        )
        text += f" ({unshaped.median:.2f}x on the unshaped one)"
    text += (
        ": every step all-gathers the home experts' parameters over the expert axis and "
        "reduce-scatters their gradients (`jaxmoe/placement/replicas.py`), whether or not a "
        "copy moved, and on this link those bytes cross between the hosts. "
    )
    dynamic = Spread.of(round_ratios(seconds["dynamic"], seconds["static"]))
    inside = dynamic.low <= 1.0 <= dynamic.high
    text += (
        f"Dynamic against static: {dynamic.format(1, 3)} per round, "
        + ("inside the spread: " if inside else "outside the spread: ")
        + "the same compiled step, plus the re-planning. Dropped fraction at the median of "
        f"these rounds: dynamic {statistics.median(shaped['dropped_fraction']['dynamic']):.4f}, "
        f"static {statistics.median(shaped['dropped_fraction']['static']):.4f}, no replicas "
        f"{statistics.median(shaped['dropped_fraction']['no replicas']):.4f} (the first steps "
        "of training; `placement_eval.md` has whole runs)."
    )
    return [text]


if __name__ == "__main__":
    sys.exit(main())
