"""BAGUA's trade-off, measured: every gradient-sync algorithm at several link speeds.

    sudo .venv/bin/python -m experiments.grad_sync_eval [--links 50,300,1000] [--repeats 2]

On the emulated cluster (``experiments.cluster``, ``experiments.netns``), each link
calibrated first (``experiments.link_calibration``; refused if it fails): 2 hosts x 4
fake devices, layout data 2 x expert 4 (each expert group inside one host, so the link
between hosts carries the data-parallel gradient synchronisation and the metric
reductions). For each link speed, every algorithm trains the same run side by side,
repeated in rotated order, all from one start of the host processes per link
(``experiments.grad_sync_runner``). Per run it records the step times, the loss curve,
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
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from experiments.cluster import Cluster
from experiments.grad_sync_report import write_report
from experiments.link_calibration import calibrate_link, ensure_calibrated
from experiments.netns import EmulatedNetwork, LinkShape, namespaces_available
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.parallel.grad_sync import ALGORITHMS
from jaxmoe.parallel.host_devices import ensure_host_devices

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


def measure_link(cluster: Cluster, args, extra, algorithms: list[str], link: float) -> list:
    """Every algorithm's runs on this link, from one start of the host processes."""
    config_path = cluster.workdir / "config.json"
    config = config_from_train_args(train_args(args, extra))
    config_path.write_text(json.dumps(config.to_dict()))
    prefix = cluster.workdir / f"{cluster.name}-runs"
    command = ["--config", str(config_path), "--algorithms", ",".join(algorithms)]
    command += ["--repeats", str(args.repeats), "--json-prefix", str(prefix)]
    command += ["--compilation-cache", str(cluster.workdir / "compilation-cache")]
    cluster.run("runs", command, module="experiments.grad_sync_runner")
    per_host = [
        json.loads(prefix.with_name(f"{prefix.name}.{i}.json").read_text()) for i in range(HOSTS)
    ]
    runs = []
    for host_runs in zip(*per_host, strict=True):
        run = dict(host_runs[0], link_mbit=link)
        run["link_bytes"] = sum(r["link_bytes"] for r in host_runs)  # sent by every host
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
    """What ``--train.grad_sync auto`` picks when told this link (estimates included)."""
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
    ensure_host_devices(HOSTS * DEVICES_PER_HOST)  # for auto's estimates, in this process
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "command": f"sudo .venv/bin/python -m experiments.grad_sync_eval {argv_text}".strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
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
            with EmulatedNetwork(HOSTS, LinkShape(rate_mbit=link)) as network:
                calibration = calibrate_link(network)
                result["link_calibration"][f"{link:g}"] = calibration.to_dict()
                if not ensure_calibrated(calibration, allow_uncalibrated=args.allow_uncalibrated):
                    return 1
                cluster = Cluster(network, Path(tmp), f"{link:g}mbit")
                result["runs"] += measure_link(cluster, args, extra, algorithms, link)
            if not args.quick:  # the links measured so far, in case a later one fails
                write_report(result, args.out)
    text = write_report(result, None if args.quick else args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
