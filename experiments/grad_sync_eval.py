"""BAGUA's trade-off, measured: every gradient-sync algorithm at several link speeds.

    sudo .venv/bin/python -m experiments.grad_sync_eval [--links 50,300,1000] [--repeats 2]

On the emulated cluster (``experiments.emulation``), each link calibrated first
(``experiments.emulation.link_calibration``; refused if it fails): 2 hosts x 4
fake devices, layout data 2 x expert 4 (each expert group inside one host, so the link
between hosts carries the data-parallel gradient synchronisation and the metric
reductions). On each link the collectives' curves are measured next (``jaxmoe
link-curves`` on the hosts, written to ``experiments/results/grad_sync_eval_curves_
<link>mbit.json``; ``--no-curves`` skips it), then every algorithm trains the same run
side by side, repeated in rotated order, all from one start of the host processes per
link (``experiments.emulation.grad_sync_runs``). Per run it records the step times, the
loss curve, and the bytes the hosts sent over the link (the ``eth0`` transmit counter of
each host's namespace, read before and after the run: compilation, the final validation
pass and the coordination service's heartbeats included, so per step they are a slight
upper bound). From them: median step time, bytes per step, loss after N steps, and the
wall-clock time (sum of step times) until the loss, averaged over 5 steps, first reaches
the target (the loss ``allreduce`` reaches after ``--target-fraction`` of the steps).
``auto``'s choice for each link (the cost model told the link speed: the cpu profile at
that link, as a profile file; and that link's measured curves) is set beside the measured
winner; ``experiments.grad_sync_convergence`` sets it beside the winner by measured
step time and measured convergence cost as well. Writes
``experiments/results/grad_sync_eval.md``, ``.json`` and ``.png``; ``--quick`` is a
smoke test (one speed, few steps, no files). ``--choices-only`` trains nothing: it measures
each link's curves again and remakes auto's choices in the results of ``--out``; with
``--saved-curves`` it only remakes the choices, from the curves files as saved (no cluster,
no root), for an estimate that changed after the measurements. ``--trial-steps N``
(default 0: none) also runs ``auto`` on each link's hosts with a trial of N steps of
the algorithms its estimates cannot tell apart (``train.grad_sync_trial_steps``), set
beside the measured winner as well; with ``--saved-curves`` the hosts are started for the
trials alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

from experiments.emulation.grad_sync_runs import run_grad_sync
from experiments.emulation.hosts import EmulatedHosts, machine
from experiments.emulation.link_calibration import LinkNotCalibrated, calibrated_network
from experiments.emulation.link_curves import config_flags, run_link_curves
from experiments.emulation.network import LinkShape, namespaces_available
from experiments.grad_sync_report import write_report
from experiments.shared.results_file import command_line
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config.choices import GRAD_SYNCS as ALGORITHMS
from jaxmoe.parallel.mesh import DATA_AXIS, EXPERT_AXIS

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


def curves_file(link: float) -> Path:
    """Where the collective curves measured on this link are kept."""
    return RESULTS / f"grad_sync_eval_curves_{link:g}mbit.json"


# The collectives the gradient syncs run and ``jaxmoe link-curves`` does not time (it times
# the all-to-all and the psums), as they run on the cluster's mesh: across hosts, the
# relaxed algorithms' ppermutes (every member to its counterpart on the other host) and
# int8's all-gather of codes; inside a host (the expert axis), the reduce-scatter and
# all-gather around the cross-host step of hierarchical, int8 and the decentralized ones.
SYNC_COLLECTIVES = (
    ("ppermute", (DATA_AXIS,)),
    ("ppermute", (DATA_AXIS, EXPERT_AXIS)),
    ("all_gather", (DATA_AXIS,)),
    ("reduce_scatter", (EXPERT_AXIS,)),
    ("all_gather", (EXPERT_AXIS,)),
)


def sync_collective(kind: str, axes: tuple[str, ...], group: int):
    """A per-device function running one collective of ``SYNC_COLLECTIVES`` on its input."""
    import jax
    import jax.numpy as jnp

    def run(x):
        if kind == "ppermute":
            shift = group // HOSTS  # the members of a group on one host
            perm = [(i, (i + shift) % group) for i in range(group)]
            return jnp.sum(jax.lax.ppermute(x, axes, perm))
        if kind == "reduce_scatter":
            return jnp.sum(jax.lax.psum_scatter(x, axes, tiled=True))
        return jnp.sum(jax.lax.all_gather(x, axes, tiled=True))

    return run


def measure_sync_curves(mesh, source: str, repeats: int = 5, chain: int = 4):
    """Curves of ``SYNC_COLLECTIVES`` on ``mesh``, timed as ``jaxmoe link-curves`` times
    its own: what one more collective adds to a chain of them, each fed by the last
    (4 KiB to 4 MiB operands, each 4x the last)."""
    import jax.numpy as jnp

    import scheduling
    from jaxmoe.parallel.timing import time_per_device

    def seconds(collective, elements: int, copies: int) -> float:
        def per_device(seed):
            for _ in range(copies):
                seed = collective(jnp.full((elements,), seed, jnp.float32)) * 1e-9
            return seed

        return statistics.median(time_per_device(per_device, mesh, warmup=1, repeats=repeats))

    curves = scheduling.CollectiveCurves(source=source)
    for kind, axes in SYNC_COLLECTIVES:
        group = 1
        for axis in axes:
            group *= mesh.shape[axis]
        collective, samples, nbytes = sync_collective(kind, axes, group), [], 4096
        while nbytes <= 4 << 20:
            elements = max(group, nbytes // 4 // group * group)
            single, several = seconds(collective, elements, 1), seconds(collective, elements, chain)
            samples.append((elements * 4, max(several - single, 1e-6) / (chain - 1)))
            nbytes *= 4
        curves.curves[(kind, group)] = scheduling.PiecewiseLinear.fit(samples)
    return curves


def sync_curves_host(argv: list[str]) -> int:
    """The host program of :func:`measure_curves`: ``SYNC_COLLECTIVES`` timed on every
    host; process 0 writes the curves to ``--json``."""
    from experiments.emulation.host_process import host_parser, start_host

    parser = host_parser("the relaxed syncs' cross-host collectives, timed")
    parser.add_argument("--source", required=True)
    args = parser.parse_args(argv)
    prepared = start_host(args)
    curves = measure_sync_curves(prepared.mesh, args.source)

    import jax

    if jax.process_index() == 0:
        curves.save(args.json)
    return 0


def measure_curves(hosts: EmulatedHosts, args, extra, link: float) -> Path:
    """The collectives of the runs' mesh timed on this link: ``jaxmoe link-curves`` (the
    all-to-all and the psums) and ``SYNC_COLLECTIVES``, in one file."""
    import scheduling

    out = curves_file(link)
    config = config_from_train_args(train_args(args, extra))
    source = f"emulated cluster: {HOSTS} hosts x {DEVICES_PER_HOST} devices, {link:g} Mbit/s"
    run_link_curves(hosts, config, out, source)
    sync_out = hosts.path("sync-curves.json")
    host_args = ["--host-sync-curves", "--config", str(hosts.write_config(config))]
    host_args += ["--json", str(sync_out), "--source", source]
    hosts.run("sync-curves", host_args, module="experiments.grad_sync_eval")
    curves = scheduling.CollectiveCurves.load(out)
    curves.curves.update(scheduling.CollectiveCurves.load(sync_out).curves)
    curves.save(out)
    return out


def auto_choice(args, extra, link: float, curves: Path | None) -> dict:
    """What ``--train.grad_sync auto`` picks when told this link and its measured curves
    (estimates included); run in a process with the cluster's devices (``main``:
    ``ensure_host_devices``)."""
    from experiments.emulation.experimental import link_profile
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.plan.grad_sync_choice import choose_grad_sync

    told = [
        *("--schedule.profile", link_profile("cpu", link)),
        *("--train.grad_sync_devices_per_host", str(DEVICES_PER_HOST)),
    ]
    if curves is not None:
        told += ["--schedule.link_curves", str(curves)]
    config = config_from_train_args(train_args(args, [*extra, *told]))
    return choose_grad_sync(config, build_mesh(config.parallel)).to_json()


def auto_trial(hosts: EmulatedHosts, args, extra, link: float, curves: Path | None) -> dict:
    """What ``--train.grad_sync auto`` picks on the hosts themselves with a trial of
    ``--trial-steps`` steps (``jaxmoe train`` of one step; process 0 writes its choice)."""
    from experiments.emulation.experimental import link_profile

    told = [
        *("--train.grad_sync", "auto", "--train.grad_sync_trial_steps", str(args.trial_steps)),
        *("--schedule.profile", link_profile("cpu", link)),
        *("--train.grad_sync_devices_per_host", str(DEVICES_PER_HOST)),
    ]
    if curves is not None:
        told += ["--schedule.link_curves", str(curves.resolve())]
    config = config_from_train_args(train_args(args, [*extra, *told]))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=1))
    out = hosts.path("auto-trial")
    flags = [*config_flags(config), "--no-progress", "--overwrite"]
    hosts.run("auto-trial", ["train", *flags, "--out", str(out)])
    return json.loads((out / "grad_sync_choice.json").read_text())


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
        "--no-curves",
        action="store_true",
        help="do not measure each link's collective curves (auto then has the profile only)",
    )
    parser.add_argument(
        "--allow-uncalibrated",
        action="store_true",
        help="measure on a link that fails calibration (warned, and recorded in the results)",
    )
    parser.add_argument(
        "--choices-only",
        action="store_true",
        help="remeasure each link's curves and remake auto's choices in the results of --out "
        "(no training runs)",
    )
    parser.add_argument(
        "--saved-curves",
        action="store_true",
        help="with --choices-only: remake auto's choices from each link's curves file as "
        "saved (no cluster: nothing is measured)",
    )
    parser.add_argument(
        "--trial-steps",
        type=int,
        default=0,
        help="auto also picks on each link's hosts with a trial of this many steps of the "
        "algorithms it cannot tell apart (0: no trial); with --saved-curves the hosts are "
        "started for the trials alone",
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 50 Mbit/s, 6 steps")
    parser.add_argument("--out", type=Path, default=RESULTS / "grad_sync_eval.md")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--host-sync-curves"]:
        return sync_curves_host(argv[1:])
    args, extra = _parse(argv)
    if args.quick:
        args.links, args.steps, args.repeats, args.warmup = "50", 6, 1, 1
    links = [float(x) for x in args.links.split(",") if x]
    algorithms = [a for a in args.algorithms.split(",") if a]
    if args.saved_curves and not args.choices_only:
        print("grad_sync_eval: --saved-curves goes with --choices-only", file=sys.stderr)
        return 2
    if args.quick:
        args.trial_steps = 0
    available, reason = namespaces_available()
    if not available and (not args.saved_curves or args.trial_steps):
        print(f"grad_sync_eval: cannot create network namespaces: {reason}", file=sys.stderr)
        return 2
    from jaxmoe.parallel.host_devices import ensure_host_devices

    ensure_host_devices(HOSTS * DEVICES_PER_HOST)  # for auto's estimates, in this process
    command = command_line("experiments.grad_sync_eval", argv)
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
        "auto_trial": {},
    }
    if args.choices_only:
        earlier = json.loads(args.out.with_suffix(".json").read_text())
        measured = {f"{run['link_mbit']:g}" for run in earlier["runs"]}
        missing = [f"{link:g}" for link in links if f"{link:g}" not in measured]
        if missing:
            print(f"grad_sync_eval: {args.out} has no runs at {', '.join(missing)} Mbit/s")
            return 2
        if args.saved_curves and args.trial_steps:
            remade = (
                "auto's choices were remade from the saved curves, and its trials run on each "
                f"link's hosts, by `sudo .venv/bin/{command}`"
            )
        elif args.saved_curves:
            remade = f"auto's choices were remade from the saved curves by `.venv/bin/{command}`"
        else:
            remade = f"The curves and auto's choices were remade by `sudo .venv/bin/{command}`"
        earlier["note"] = f"{remade}, after the runs."
        result = earlier
    if args.saved_curves:
        for link in links:
            curves = curves_file(link)
            if not curves.exists():
                print(f"grad_sync_eval: no saved curves at {link:g} Mbit/s ({curves})")
                return 2
            result["auto"][f"{link:g}"] = auto_choice(args, extra, link, curves)
        if not args.trial_steps:
            text = write_report(result, args.out)
            print(text)
            return 0
    with tempfile.TemporaryDirectory(prefix="jaxmoe-grad-sync-") as tmp:
        for link in links:
            try:
                with calibrated_network(
                    HOSTS, LinkShape(rate_mbit=link), allow_uncalibrated=args.allow_uncalibrated
                ) as (network, calibration):
                    if not args.choices_only:  # the runs' link, not the curves' pass
                        result["link_calibration"][f"{link:g}"] = calibration.to_dict()
                    hosts = EmulatedHosts(network, Path(tmp), f"{link:g}mbit")
                    curves = None
                    if args.saved_curves:
                        curves = curves_file(link)
                    elif not args.no_curves and not args.quick:
                        curves = measure_curves(hosts, args, extra, link)
                    if not args.saved_curves:
                        choice = auto_choice(args, extra, link, curves)
                        result["auto"][f"{link:g}"] = choice
                        print(f"{link:g} Mbit/s: auto -> {choice['chosen']}", flush=True)
                    if args.trial_steps:
                        trial = auto_trial(hosts, args, extra, link, curves)
                        result.setdefault("auto_trial", {})[f"{link:g}"] = trial
                        print(f"{link:g} Mbit/s: auto with a trial -> {trial['chosen']}")
                    if not args.choices_only:
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
