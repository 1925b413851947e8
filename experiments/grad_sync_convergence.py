"""The relaxed gradient syncs against allreduce over whole runs: final loss, and the steps
each needs to reach allreduce's loss (the convergence cost ``train.grad_sync auto`` uses).

    python -m experiments.grad_sync_convergence [--seeds 0,1,2] [--steps 200]

Every algorithm trains the ``tiny`` preset for ``--steps`` steps on data 2 x expert 4 in
one process of 8 fake CPU devices, as ``jaxmoe train --preset tiny --steps 200
--parallel.data 2 --parallel.expert 4 --train.grad_sync X
--train.grad_sync_devices_per_host 4`` would: hosts of 4 devices, the emulated cluster's
(each expert group on one host, the data replicas on two), so that what the relaxed
algorithms relax is what they relax there (without hosts, one process is one host and
nothing is relaxed). Each seed (``train.seed``: initialisation and data order) is run by
every algorithm, so the comparison with allreduce is paired. With ``--stress-seeds``,
the relaxed algorithms also run with hosts of one device (every device a worker of its
own: rings of 8 for the dense parameters).

Per run: the training loss of every step and the validation loss (4 batches) every 50
steps and at the end. Reported per algorithm (median over seeds, with min-max): the
final training loss (mean of the last ``--window`` steps) and validation loss, each
against allreduce's of the same seed; and the convergence cost, the steps an algorithm
takes until its loss (mean of ``--window`` steps) first reaches the loss allreduce
reaches after a fraction of the run, divided by allreduce's steps (1.0: no cost; at the
fraction ``grad_sync_choice.TARGET_FRACTION`` it is what ``auto`` reads).

Writes ``experiments/results/grad_sync_convergence.{md,json}`` and the costs file
``jaxmoe/plan/grad_sync_convergence.json`` that ``train.grad_sync auto`` loads.
``--from-json`` rewrites both from the runs of an earlier results file (no training).
The file ends with auto's choice at each link speed of the emulated cluster beside the
winners measured there (:func:`auto_against_measured`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "grad_sync_convergence.md"
ALGORITHMS = ("allreduce", "int8", "decentralized", "decentralized-int8", "delayed")
REFERENCE = "allreduce"
FRACTIONS = (0.5, 0.7, 0.9)  # of the run: the targets of the convergence cost
CLUSTER_HOSTS = 4  # devices per host on the emulated cluster (data 2 x expert 4)


def train_args(algorithm: str, seed: int, per_host: int, steps: int) -> list[str]:
    return [
        *("--preset", "tiny", "--steps", str(steps)),
        *("--parallel.data", "2", "--parallel.expert", "4"),
        *("--train.grad_sync", algorithm, "--train.seed", str(seed)),
        *("--train.grad_sync_devices_per_host", str(per_host)),
    ]


def train_run(algorithm: str, seed: int, per_host: int, steps: int) -> dict:
    """One run's losses, trained in this process (as ``jaxmoe train`` trains it)."""
    from jaxmoe.cli.parser import config_from_train_args
    from jaxmoe.prepare import prepare_run
    from jaxmoe.train import loop

    config = config_from_train_args(train_args(algorithm, seed, per_host, steps))
    rows = loop.train(prepare_run(config), None, progress=False)
    return {
        "algorithm": algorithm,
        "seed": seed,
        "devices_per_host": per_host,
        "loss": [row["loss"] for row in rows],
        "val_loss": {str(row["step"] + 1): row["val_loss"] for row in rows if "val_loss" in row},
        "step_s": [row["step_time_s"] for row in rows],
    }


def smoothed(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def steps_to(curve: list[float], target: float) -> int | None:
    """Steps until ``curve`` (smoothed) first reaches ``target``; None if it never does."""
    return next((step + 1 for step, loss in enumerate(curve) if loss <= target), None)


def convergence_ratios(run: dict, reference: dict, window: int, fraction: float) -> float | None:
    """Steps ``run`` takes to reach the loss ``reference`` reaches after ``fraction`` of its
    steps, over ``reference``'s steps to it (None: never reached)."""
    ours, theirs = smoothed(run["loss"], window), smoothed(reference["loss"], window)
    at = max(1, round(fraction * len(theirs)))
    target = theirs[at - 1]
    needed, reference_steps = steps_to(ours, target), steps_to(theirs, target)
    return None if needed is None else needed / reference_steps


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def summarise(result: dict) -> dict[str, dict]:
    """``"<algorithm> (hosts of <n>)" -> figures``, each paired with allreduce's run of
    the same seed: final losses, their ratios, and the convergence cost at each
    fraction."""
    window = result["window"]
    reference = {r["seed"]: r for r in result["runs"] if r["algorithm"] == REFERENCE}
    last = str(result["steps"])
    groups: dict[str, list[dict]] = {}
    for run in result["runs"]:
        key = f"{run['algorithm']} (hosts of {run['devices_per_host']})"
        groups.setdefault(key, []).append(run)
    table = {}
    for key, runs in groups.items():
        pairs = [(run, reference[run["seed"]]) for run in runs]
        final = [statistics.fmean(run["loss"][-window:]) for run in runs]
        reference_final = [statistics.fmean(ref["loss"][-window:]) for _, ref in pairs]
        table[key] = {
            "algorithm": runs[0]["algorithm"],
            "devices_per_host": runs[0]["devices_per_host"],
            "seeds": [run["seed"] for run in runs],
            "final_loss": spread(final),
            "final_ratio": spread([f / r for f, r in zip(final, reference_final, strict=True)]),
            "val_loss": spread([run["val_loss"][last] for run in runs]),
            "val_ratio": spread(
                [run["val_loss"][last] / ref["val_loss"][last] for run, ref in pairs]
            ),
            "cost": {},
        }
        for fraction in FRACTIONS:
            ratios = [convergence_ratios(run, ref, window, fraction) for run, ref in pairs]
            table[key]["cost"][f"{fraction:g}"] = None if None in ratios else spread(ratios)
    return table


def convergence_costs(result: dict, table: dict, fraction: float) -> dict:
    """The file ``train.grad_sync auto`` reads: each relaxed algorithm's convergence cost
    (median over seeds) on the cluster's hosts, with where it was measured."""
    costs = {}
    for row in table.values():
        if row["algorithm"] != REFERENCE and row["devices_per_host"] == CLUSTER_HOSTS:
            cost = row["cost"][f"{fraction:g}"]
            costs[row["algorithm"]] = None if cost is None else round(cost["median"], 4)
    return {
        "source": (
            f"{result['command']}: tiny preset, data 2 x expert 4, hosts of {CLUSTER_HOSTS} "
            f"devices, {result['steps']} steps, seeds {result['seeds']}; steps to the loss "
            f"allreduce reaches after {fraction:.0%} of the run (mean of {result['window']} "
            "steps), over allreduce's, median over seeds"
        ),
        "target_fraction": fraction,
        "steps_per_allreduce_step": costs,
    }


def eval_results() -> dict[str, tuple[Path, dict]]:
    """Each link speed measured on the emulated cluster (``experiments.grad_sync_eval``)
    and the results that hold it: ``grad_sync_eval.json`` first, then the others."""
    files = sorted(
        RESULTS.glob("grad_sync_eval*.json"),
        key=lambda path: (path.name != "grad_sync_eval.json", path.name),
    )
    found: dict[str, tuple[Path, dict]] = {}
    for path in files:
        result = json.loads(path.read_text())
        if "runs" not in result:  # a link's collective curves, kept beside the runs
            continue
        for link in sorted({f"{run['link_mbit']:g}" for run in result["runs"]}, key=float):
            found.setdefault(link, (path, result))
    return found


def auto_choice(result: dict, link: str, costs_file: Path) -> tuple[dict, Path | None]:
    """What ``train.grad_sync auto`` picks for the run of ``result`` when told ``link`` and
    given that link's measured curves (where they were measured) and the costs."""
    from experiments.emulation.experimental import link_profile, saved_config
    from experiments.grad_sync_eval import DEVICES_PER_HOST, curves_file
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.plan.grad_sync_choice import ConvergenceCosts, choose_grad_sync

    config, _ = saved_config(result["config"])
    curves = curves_file(float(link))
    curves = curves if curves.exists() else None
    schedule = dataclasses.replace(
        config.schedule,
        profile=link_profile("cpu", float(link)),
        link_curves=None if curves is None else str(curves),
    )
    train = dataclasses.replace(config.train, grad_sync_devices_per_host=DEVICES_PER_HOST)
    config = dataclasses.replace(config, schedule=schedule, train=train)
    choice = choose_grad_sync(
        config, build_mesh(config.parallel), ConvergenceCosts.load(costs_file)
    )
    return choice.to_json(), curves


def auto_against_measured(costs_file: Path, command: str) -> str:
    """For each link of the emulated cluster: the measured winners beside auto's choice
    (``command``: the one that makes this section)."""
    from experiments import grad_sync_report as report

    costs = json.loads(costs_file.read_text())["steps_per_allreduce_step"]
    cost_of = lambda name: 1.0 if name in report.EXACT else costs.get(name)
    lines = [
        "## auto's choice against the measured winner",
        "",
        f"Made by `{command}` (auto's estimates as the code makes them now).",
        "",
        "For each link speed of the emulated cluster (2 hosts x 4 devices, "
        "`experiments/grad_sync_eval.py`): the winner measured there (the least time, summed "
        "step times, to the loss allreduce reaches after 70% of its steps), the winner by "
        "measured step time times the convergence cost above (the same product auto "
        "estimates, both factors measured), and what `--train.grad_sync auto` picks when told "
        "the link (profile cpu at that link, as a profile file; hosts of 4), that link's measured "
        "collective curves (`experiments/results/grad_sync_eval_curves_<link>mbit.json`), and "
        "the convergence costs (`jaxmoe/plan/grad_sync_convergence.json`).",
        "",
        "| link (Mbit/s) | results | measured winner (time to target) | within the spread "
        "of the winner's time | winner by measured step x convergence cost | auto | curves |",
        "|---|---|---|---|---|---|---|",
    ]
    details = []
    for link, (path, result) in sorted(eval_results().items(), key=lambda item: float(item[0])):
        rows = report.summarise(result)[link]
        winner = report._winner(rows)  # the report's own definition
        product = {
            name: row["step_s"] * cost_of(name) for name, row in rows.items() if cost_of(name)
        }
        by_cost = min(product, key=product.get)
        choice, curves = auto_choice(result, link, costs_file)
        estimates = {e["name"]: e for e in choice["estimates"]}
        chosen = choice["chosen"]
        close = report.within_spread(rows, winner)
        if chosen == winner:
            agreement = "agrees"
        else:
            agreement = "differs, within the spread" if chosen in close else "differs"
        spread = ", ".join(close) if close else "none"
        lines.append(
            f"| {link} | `{path.name}` | {winner} | {spread} | {by_cost} "
            f"| {chosen} ({agreement}) | {curves.name if curves else 'none: profile link'} |"
        )
        details += [
            f"### {link} Mbit/s",
            "",
            "| algorithm | measured step (ms) | time to target (s) | convergence cost "
            "| step x cost (ms) | auto's step (ms) | auto's step x cost (ms) |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, row in rows.items():
            estimated = estimates[name]["step_seconds"] if name in estimates else math.nan
            cost = cost_of(name)
            low, high = row["step_spread_s"]
            time = report._seconds(row["time_to_target_s"], row["time_spread_s"])
            details.append(
                f"| {name} | {row['step_s'] * 1e3:.0f} ({low * 1e3:.0f}-{high * 1e3:.0f}) "
                f"| {time} "
                f"| {'-' if cost is None else f'{cost:.3f}'} "
                f"| {'-' if cost is None else f'{product[name] * 1e3:.0f}'} "
                f"| {estimated * 1e3:.0f} "
                f"| {'-' if cost is None else f'{estimated * cost * 1e3:.0f}'} |"
            )
        verdict = report.auto_verdict(rows, winner, chosen)
        details += ["", f"auto: {chosen}: {choice['reason']}; it {verdict}.", ""]
    return "\n".join([*lines, "", *details])


def _ratio(s: dict | None, digits: int = 3) -> str:
    if s is None:
        return "not reached"
    return f"{s['median']:.{digits}f} [{s['low']:.{digits}f}-{s['high']:.{digits}f}]"


def _within(row: dict, limit: float = 1.05) -> bool:
    return row["final_ratio"]["high"] <= limit and row["val_ratio"]["high"] <= limit


def format_markdown(result: dict, table: dict, choices_text: str) -> str:
    window, steps = result["window"], result["steps"]
    lines = [
        "# Relaxed gradient sync: convergence against allreduce",
        "",
        f"Command: `{result['command']}`",
        "",
        f"The `tiny` preset, {steps} steps, data 2 x expert 4 in one process of 8 fake CPU "
        f"devices ({result['machine']}): `jaxmoe train --preset tiny --steps {steps} "
        "--parallel.data 2 --parallel.expert 4 --train.grad_sync X "
        f"--train.grad_sync_devices_per_host {CLUSTER_HOSTS}`, seeds {result['seeds']} "
        "(`--train.seed`: initialisation and data order; every algorithm runs every seed, "
        "and each figure is paired with allreduce's run of the same seed). Hosts of "
        f"{CLUSTER_HOSTS} devices are the emulated cluster's: a worker is one host's "
        "replicas of a parameter, exact inside the host, relaxed across hosts "
        "(`jaxmoe/parallel/grad_sync/workers.py`); in one process without them, the "
        "process is one host and nothing would be relaxed. Hosts of 1 (every device a "
        "worker, the dense parameters on rings of 8) are the harder case.",
        "",
        f"- **final loss**: mean training loss of the last {window} steps; **/ allreduce**: "
        "its ratio to allreduce's, same seed;",
        f"- **val loss**: validation loss after step {steps} (4 batches), and its ratio;",
        f"- **convergence cost at f**: steps until the loss (mean of {window} steps) first "
        f"reaches the loss allreduce reaches after f x {steps} steps, over allreduce's steps "
        "(1.000: none; `not reached` within the run).",
        "",
        "Median over seeds [min-max].",
        "",
        "| algorithm | seeds | final loss | / allreduce | val loss | / allreduce "
        + "".join(f"| cost at {f:g} " for f in FRACTIONS)
        + "|",
        "|---|---|---|---|---|---|" + "---|" * len(FRACTIONS),
    ]
    for key, row in table.items():
        lines.append(
            f"| {key} | {len(row['seeds'])} | {_ratio(row['final_loss'])} "
            f"| {_ratio(row['final_ratio'])} | {_ratio(row['val_loss'])} "
            f"| {_ratio(row['val_ratio'])} "
            + "".join(f"| {_ratio(row['cost'][f'{f:g}'])} " for f in FRACTIONS)
            + "|"
        )
    relaxed = [
        (key, row)
        for key, row in table.items()
        if row["algorithm"] != REFERENCE and row["devices_per_host"] == CLUSTER_HOSTS
    ]
    met = [key for key, row in relaxed if _within(row)]
    missed = [key for key, row in relaxed if not _within(row)]
    lines += [
        "",
        "## Target",
        "",
        f"Each relaxed algorithm within 5% of allreduce's final loss over {steps} steps "
        f"(training and validation, every seed), on the cluster's hosts: "
        + ("met by " + ", ".join(met) if met else "met by none")
        + ("; not met by " + ", ".join(missed) if missed else "")
        + ".",
        "",
        choices_text,
    ]
    return "\n".join(lines).rstrip() + "\n"


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.grad_sync_convergence", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--stress-seeds", default="0", help="seeds of the hosts-of-1 runs")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20, help="steps in a smoothed loss")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--costs-out", type=Path, default=None, help="default: the file auto reads")
    parser.add_argument("--from-json", type=Path, help="rewrite the results from these runs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from experiments.emulation.hosts import machine
    from jaxmoe.parallel.host_devices import ensure_host_devices
    from jaxmoe.plan.grad_sync_choice import CONVERGENCE_FILE, TARGET_FRACTION

    ensure_host_devices(8)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        argv = sys.argv[1:] if argv is None else argv
        seeds = [int(s) for s in args.seeds.split(",") if s]
        stress = [int(s) for s in args.stress_seeds.split(",") if s]
        algorithms = [a for a in args.algorithms.split(",") if a]
        result = {
            "command": command_line("experiments.grad_sync_convergence", argv),
            "machine": machine(),
            "steps": args.steps,
            "window": args.window,
            "seeds": seeds,
            "runs": [],
        }
        plan = [(a, s, CLUSTER_HOSTS) for s in seeds for a in algorithms]
        plan += [(a, s, 1) for s in stress for a in algorithms if a != REFERENCE]
        for algorithm, seed, per_host in plan:
            run = train_run(algorithm, seed, per_host, args.steps)
            result["runs"].append(run)
            print(
                f"{algorithm} seed {seed} hosts of {per_host}: final loss "
                f"{statistics.fmean(run['loss'][-args.window :]):.4f}, val loss "
                f"{run['val_loss'][str(args.steps)]:.4f}",
                flush=True,
            )
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    table = summarise(result)
    costs_file = args.costs_out or CONVERGENCE_FILE
    costs = convergence_costs(result, table, TARGET_FRACTION)
    costs_file.write_text(json.dumps(costs, indent=1) + "\n")
    argv = sys.argv[1:] if argv is None else argv
    choices_text = auto_against_measured(
        costs_file, command_line("experiments.grad_sync_convergence", argv)
    )
    text = format_markdown(result, table, choices_text)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
