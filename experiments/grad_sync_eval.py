"""BAGUA's trade-off, measured: every gradient-sync algorithm at several link speeds.

    sudo .venv/bin/python -m experiments.grad_sync_eval [--links 50,300,1000] [--repeats 2]

On the emulated cluster (``experiments.emulation``), each link calibrated first
(``experiments.emulation.link_calibration``; refused if it fails): 2 hosts x 4
fake devices, layout data 2 x expert 4 (each expert group inside one host, so the link
between hosts carries the data-parallel gradient synchronisation and the metric
reductions). For each link speed, every algorithm trains the same run side by side,
repeated in rotated order, all from one start of the host processes per link
(``experiments.emulation.grad_sync_runs``). Per run it records the step times, the loss curve,
and the bytes the hosts sent over the link (the ``eth0`` transmit counter of each host's
namespace, read before and after the run: compilation, the final validation pass and the
coordination service's heartbeats included, so per step they are a slight upper bound).
From them: median step time, bytes per step, loss after N steps, and the wall-clock time
(sum of step times) until the loss, averaged over 5 steps, first reaches the target (the
loss ``allreduce`` reaches after ``--target-fraction`` of the steps). ``auto``'s choice
for each link (the cost model told the link speed, ``--schedule.link_mbit``) is
set beside the measured winner. Writes ``experiments/results/grad_sync_eval.md``,
``.json`` and ``.png``; ``--quick`` is a smoke test (one speed, few steps, no files).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

from experiments.emulation.grad_sync_runs import run_grad_sync
from experiments.emulation.hosts import EmulatedHosts, machine
from experiments.emulation.link_calibration import LinkNotCalibrated, calibrated_network
from experiments.emulation.network import LinkShape, namespaces_available
from experiments.grad_sync_report import write_report
from experiments.shared.results_file import command_line
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config.choices import GRAD_SYNCS as ALGORITHMS

HOSTS, DEVICES_PER_HOST = 2, 4
SMOOTHING = 5  # steps in the loss average that the target is checked against
RESULTS = Path(__file__).parent / "results"


def train_args(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [
        *("--preset", args.preset),
        *("--parallel.data", str(HOSTS), "--parallel.expert", str(DEVICES_PER_HOST)),
        *("--train.batch_size", str(args.batch_size)),
        *("--train.warmup_steps", str(args.warmup_steps)),
        *("--train.eval_every", str(10 * args.steps)),
        *("--steps", str(args.steps)),
        *extra,
    ]


def measure_link(hosts: EmulatedHosts, args, extra, algorithms: list[str], link: float) -> list:
    """Every algorithm's runs on this link, from one start of the host processes."""
    config_path = hosts.write_config(config_from_train_args(train_args(args, extra)))
    cache = hosts.workdir / "compilation-cache"
    per_host = run_grad_sync(hosts, config_path, algorithms, args.repeats, cache)
    runs = []
    for host_runs in zip(*per_host, strict=True):
        run = dict(dataclasses.asdict(host_runs[0]), link_mbit=link)
        run["link_bytes"] = sum(r.link_bytes for r in host_runs)  # sent by every host
        runs.append(run)
        print(
            f"{link:g} Mbit/s {run['algorithm']} #{run['repeat']}: median step "
            f"{statistics.median(run['step_s'][args.warmup :]) * 1e3:.0f} ms, "
            f"loss {run['loss'][-1]:.3f}, "
            f"{run['link_bytes'] / len(run['loss']) / HOSTS / 1e6:.2f} MB/step per host",
            flush=True,
        )
    return runs


def auto_choice(args, extra, link: float) -> dict:
    """What ``--train.grad_sync auto`` picks when told this link (estimates included);
    run in a process with the cluster's devices (``main``: ``ensure_host_devices``)."""
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.plan.grad_sync_choice import choose_grad_sync

    told = [
        *("--schedule.profile", "cpu", "--schedule.link_mbit", f"{link:g}"),
        *("--train.grad_sync_devices_per_host", str(DEVICES_PER_HOST)),
    ]
    if args.link_curves:
        told += ["--schedule.link_curves", str(args.link_curves)]
    config = config_from_train_args(train_args(args, [*extra, *told]))
    return choose_grad_sync(config, build_mesh(config.parallel)).to_json()


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.grad_sync_eval", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--links", default="50,300,1000", help="Mbit/s, comma-separated")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=5, help="learning-rate warm-up")
    parser.add_argument("--target-fraction", type=float, default=0.7)
    parser.add_argument(
        "--link-curves", type=Path, help="measured link curves to give auto (its cost model)"
    )
    parser.add_argument(
        "--allow-uncalibrated",
        action="store_true",
        help="measure on a link that fails calibration (warned, and recorded in the results)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 50 Mbit/s, 6 steps")
    parser.add_argument("--out", type=Path, default=RESULTS / "grad_sync_eval.md")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, extra = _parse(argv)
    if args.quick:
        args.links, args.steps, args.repeats, args.warmup = "50", 6, 1, 1
    links = [float(x) for x in args.links.split(",") if x]
    algorithms = [a for a in args.algorithms.split(",") if a]
    available, reason = namespaces_available()
    if not available:
        print(f"grad_sync_eval: cannot create network namespaces: {reason}", file=sys.stderr)
        return 2
    from jaxmoe.parallel.host_devices import ensure_host_devices

    ensure_host_devices(HOSTS * DEVICES_PER_HOST)  # for auto's estimates, in this process
    command = command_line("experiments.grad_sync_eval", sys.argv[1:] if argv is None else argv)
    result = {
        "command": f"sudo .venv/bin/{command}",
        "machine": machine(),
        "hosts": HOSTS,
        "devices_per_host": DEVICES_PER_HOST,
        "link_calibration": {},
        "config": config_from_train_args(train_args(args, extra)).to_dict(),
        "steps": args.steps,
        "warmup": args.warmup,
        "target_fraction": args.target_fraction,
        "smoothing": SMOOTHING,
        "runs": [],
        "auto": {},
    }
    with tempfile.TemporaryDirectory(prefix="jaxmoe-grad-sync-") as tmp:
        for link in links:
            choice = auto_choice(args, extra, link)
            result["auto"][f"{link:g}"] = choice
            print(f"{link:g} Mbit/s: auto -> {choice['chosen']}", flush=True)
            try:
                with calibrated_network(
                    HOSTS, LinkShape(rate_mbit=link), allow_uncalibrated=args.allow_uncalibrated
                ) as (network, calibration):
                    result["link_calibration"][f"{link:g}"] = calibration.to_dict()
                    hosts = EmulatedHosts(network, Path(tmp), f"{link:g}mbit")
                    result["runs"] += measure_link(hosts, args, extra, algorithms, link)
            except LinkNotCalibrated:
                return 1
            if not args.quick:  # the links measured so far, in case a later one fails
                write_report(result, args.out)
    text = write_report(result, None if args.quick else args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
