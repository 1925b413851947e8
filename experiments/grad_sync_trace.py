"""Where each gradient-sync algorithm's step goes on the emulated cluster, op by op, beside
what ``train.grad_sync auto`` estimates for the same ops.

    sudo .venv/bin/python -m experiments.grad_sync_trace [--links 50,1000] \\
        [--algorithms int8,decentralized-int8] [--rounds 4]

The cluster of ``experiments.grad_sync_eval`` (2 hosts x 4 fake CPU devices, data 2 x
expert 4, ``tiny``, batch 64), each link calibrated first. On each link one start of the
host processes compiles every algorithm's train step (the step as written, as the
evaluation's runs train it), runs them in interleaved rounds (``--warmup`` untimed, then
``--rounds`` timed; the order reversed every other round) and then traces
``TRACED_STEPS`` steps of each under ``jax.profiler`` (every process its own devices).

From each trace (every complete step on every device of both processes): the seconds of
each XLA op, grouped by what it holds (its equations' name stacks and primitives): the
synchronisation's ops (name scopes ``grad_reduce`` and ``param_mix``) and the rest, each
split into collectives and computation. Beside each group, auto's estimate of the same ops
(its cost model told the link, the link's measured curves
``experiments/results/grad_sync_eval_curves_<link>mbit.json`` and ``--op-costs``, as
``experiments.grad_sync_eval`` tells it). The largest of the synchronisation's XLA ops are
listed one by one. Writes ``experiments/results/grad_sync_trace.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from experiments.emulation.hosts import EmulatedHosts, machine
from experiments.emulation.link_calibration import LinkNotCalibrated, calibrated_network
from experiments.emulation.network import LinkShape, namespaces_available
from experiments.shared.results_file import command_line
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results"
HOSTS, DEVICES_PER_HOST = 2, 4
TRACED_STEPS = 2
LISTED_S = 1e-4  # the synchronisation's XLA ops kept one by one in the results (the rest
# counts in their group only); the markdown lists those over 1 ms
# XLA's collectives, by instruction name (``all-gather.3``, ``all_gather.38``).
_COLLECTIVE = re.compile(
    r"^(all[-_]reduce|all[-_]gather|reduce[-_]scatter|all[-_]to[-_]all|collective[-_]permute|"
    r"psum|ppermute)"
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# XLA's combiners name a combined op ``prefix/(a/psum:b/psum)``: one name per equation.
_COMBINED = re.compile(r"^(.*?)\(([^()]*:[^()]*)\)$")


def combined_keys(text: str) -> set[tuple[str, str]]:
    """The equations a combined collective's ``op_name`` names (empty for any other)."""
    from scheduling import equation_key

    keys = set()
    for op_name in _OP_NAME.findall(text):
        found = _COMBINED.match(op_name)
        if found:
            for part in found.group(2).split(":"):
                key = equation_key(found.group(1) + part)
                if key is not None:
                    keys.add(key)
    return keys


def host_main(argv: list[str]) -> int:
    """The host program: every algorithm's step compiled, timed in rounds, traced."""
    import time

    from experiments.emulation.host_process import (
        round_order,
        rounds_parser,
        start_host,
        train_batches,
    )

    parser = rounds_parser("the gradient-sync algorithms' steps, timed and traced")
    parser.add_argument("--algorithms", required=True)
    parser.add_argument("--trace", type=Path, required=True)
    args = parser.parse_args(argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    prepared = start_host(args)
    config, mesh = prepared.config, prepared.mesh
    sampler = train_batches(config)

    import jax

    from jaxmoe.data.batches import put_on_mesh
    from jaxmoe.train.scheduled import scheduled_train_step
    from jaxmoe.train.state import init_train_state

    steps, states = {}, {}
    for name in algorithms:
        train = dataclasses.replace(config.train, grad_sync=name)
        with_algorithm = dataclasses.replace(config, train=train)
        steps[name] = scheduled_train_step(resolve(with_algorithm, mesh)).compile()
        states[name] = init_train_state(resolve(with_algorithm, mesh))
    seconds: dict[str, list[float]] = {name: [] for name in algorithms}
    batch = None
    for round_index in range(args.warmup + args.rounds):
        batch = put_on_mesh(sampler, round_index, mesh)
        jax.block_until_ready(batch)
        for name in round_order(algorithms, round_index):
            started = time.perf_counter()
            states[name], metrics = steps[name](states[name], batch)
            jax.block_until_ready((states[name], metrics))
            if round_index >= args.warmup:
                seconds[name].append(time.perf_counter() - started)
    for name in algorithms:
        directory = args.trace / name
        directory.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            (directory / "step.hlo.txt").write_text(steps[name].as_text())
        with jax.profiler.trace(str(directory / f"process_{jax.process_index()}")):
            for _ in range(TRACED_STEPS):
                states[name], metrics = steps[name](states[name], batch)
                jax.block_until_ready((states[name], metrics))
    if jax.process_index() == 0:
        args.json.write_text(json.dumps({"seconds": seconds}))
    return 0


def _group(stacks: set[str], sync_scopes: tuple[str, ...]) -> str:
    return "sync" if any(s in stack for stack in stacks for s in sync_scopes) else "rest"


def measured_ops(directory: Path) -> dict:
    """One algorithm's traced ops: per XLA op its mean seconds per device per step (both
    processes), whether it is a collective, its keys and its instruction's text."""
    from scheduling import hlo_op_keys, read_trace

    hlo = (directory / "step.hlo.txt").read_text()
    keys = hlo_op_keys(hlo)
    text = {}
    for line in hlo.splitlines():
        found = _INSTRUCTION.match(line)
        if found:
            text[found.group(1)] = found.group(2)
    per_process = [read_trace(path) for path in sorted(directory.glob("process_*"))]
    names = set().union(*(m.seconds for m in per_process))
    ops = {}
    for name in names:
        held = set(keys[name].held) if name in keys else set()
        combined = combined_keys(text.get(name, ""))
        if combined:  # the combined op's own key is no equation's
            held = {k for k in held if not k[1].endswith(")")} | combined
        ops[name] = {
            "seconds": statistics.fmean(m.seconds.get(name, 0.0) for m in per_process),
            "collective": bool(_COLLECTIVE.match(name)),
            "keys": sorted(held),
            "text": text.get(name, ""),
        }
    return {
        "traced_step_s": statistics.fmean(m.step_seconds for m in per_process),
        "steps": [m.steps for m in per_process],
        "ops": ops,
    }


def estimated_ops(algorithm: str, link: float, op_costs: str) -> dict:
    """auto's estimate of ``algorithm``'s step on ``link`` (as ``grad_sync_eval`` tells it),
    per key (name stack, primitive) and kind; run with the cluster's devices."""
    from experiments.emulation.experimental import link_profile
    from experiments.grad_sync_eval import DEVICES_PER_HOST as PER_HOST
    from experiments.grad_sync_eval import _parse, curves_file, train_args
    from jaxmoe.cli.parser import config_from_train_args
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.plan.grad_sync_choice import choice_cost_model
    from jaxmoe.train.scheduled import capture_train_step

    args, extra = _parse([])
    told = [
        *("--schedule.profile", link_profile("cpu", link)),
        *("--train.grad_sync_devices_per_host", str(PER_HOST)),
        *("--schedule.op_costs", op_costs),
        *("--train.grad_sync", algorithm),
    ]
    curves = curves_file(link)
    if curves.exists():
        told += ["--schedule.link_curves", str(curves)]
    config = config_from_train_args(train_args(args, [*extra, *told]))
    mesh = build_mesh(config.parallel)
    cost, words = choice_cost_model(config, mesh)
    program, _ = capture_train_step(resolve(config, mesh))
    ops = [
        {
            "key": [op.name_stack, op.primitive],
            "collective": op.is_collective,
            "elements": sum(math.prod(v.aval.shape) for v in op.outputs),
            "seconds": cost.seconds(op),
        }
        for op in program.ops
    ]
    return {"link": words, "ops": ops}


def _sizes(text: str) -> list[int]:
    """The elements of each of an instruction's results (one for an array, one per member
    of a tuple)."""
    shape = text.split(" ", 1)[0] if not text.startswith("(") else text[: text.index(")") + 1]
    return [math.prod(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(shape)]


def compare(measured: dict, estimated: dict, sync_scopes: tuple[str, ...]) -> dict:
    """Measured and estimated seconds per group (sync or rest, collective or compute), and
    the sync's XLA ops one by one (those of ``LISTED_S`` or more), each with the estimate of
    the equations it holds: a collective one equation of its keys per result (a combined
    one has several) of that result's size; then every op the equations of its keys not
    yet counted (the longest op first)."""
    left = list(range(len(estimated["ops"])))
    ops = estimated["ops"]
    groups: dict[str, dict[str, float]] = defaultdict(lambda: {"measured": 0.0, "estimated": 0.0})
    rows = []
    ordered = sorted(measured["ops"].items(), key=lambda item: -item[1]["seconds"])
    # Collectives first: each takes the equations of its keys and its size.
    mine: dict[str, list[int]] = {}
    for name, op in ordered:
        if op["collective"]:
            keys = [list(k) for k in op["keys"]]
            mine[name] = []
            for size in _sizes(op["text"]):  # one equation per result
                found = [i for i in left if ops[i]["key"] in keys and ops[i]["elements"] == size]
                mine[name] += found[:1]
                left = [i for i in left if i not in found[:1]]
    # Then every op takes what is left of its keys (XLA may split or reshape a collective).
    for name, op in ordered:
        keys = [list(k) for k in op["keys"]]
        found = [i for i in left if ops[i]["key"] in keys]
        mine[name] = mine.get(name, []) + found
        left = [i for i in left if i not in found]
    for name, op in ordered:
        keys = [list(k) for k in op["keys"]]
        estimated_s = sum(ops[i]["seconds"] for i in mine[name])
        group = _group({k[0] for k in keys}, sync_scopes) if keys else "rest"
        kind = "collective" if op["collective"] else "compute"
        groups[f"{group} {kind}"]["measured"] += op["seconds"]
        groups[f"{group} {kind}"]["estimated"] += estimated_s
        if group == "sync" and op["seconds"] >= LISTED_S:
            rows.append(
                {
                    "op": name,
                    "kind": kind,
                    "measured_s": op["seconds"],
                    "estimated_s": estimated_s,
                    "holds": sorted({k[1] for k in keys}),
                    "text": op["text"][:160],
                }
            )
    unmatched = sum(ops[i]["seconds"] for i in left)
    return {"groups": dict(groups), "sync_ops": rows, "estimated_unmatched_s": unmatched}


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.grad_sync_trace", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--links", default="50,1000", help="Mbit/s, comma-separated")
    parser.add_argument("--algorithms", default="int8,decentralized-int8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--op-costs", default="analytic", help="auto's op costs, as told")
    parser.add_argument("--allow-uncalibrated", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "grad_sync_trace.md")
    return parser.parse_known_args(argv)


def measure(args, extra, link: float, algorithms: list[str], workdir: Path) -> dict:
    """On one calibrated link: the rounds' step times and each algorithm's traced ops."""
    from experiments.grad_sync_eval import train_args as eval_train_args
    from jaxmoe.cli.parser import config_from_train_args

    evaluation = argparse.Namespace(
        preset="tiny", batch_size=64, warmup_steps=5, steps=args.rounds + args.warmup
    )
    config = config_from_train_args(eval_train_args(evaluation, extra))
    with calibrated_network(
        HOSTS, LinkShape(rate_mbit=link), allow_uncalibrated=args.allow_uncalibrated
    ) as (network, calibration):
        hosts = EmulatedHosts(network, workdir, f"{link:g}mbit")
        out, traces = hosts.path("rounds.json"), hosts.path("traces")
        host_args = ["--host", "--config", str(hosts.write_config(config))]
        host_args += ["--json", str(out), "--trace", str(traces)]
        host_args += ["--algorithms", ",".join(algorithms)]
        host_args += ["--rounds", str(args.rounds), "--warmup", str(args.warmup)]
        hosts.run("trace", host_args, module="experiments.grad_sync_trace")
        seconds = json.loads(out.read_text())["seconds"]
        return {
            "calibration": calibration.to_dict(),
            "step_s": seconds,
            "traced": {name: measured_ops(traces / name) for name in algorithms},
        }


def format_markdown(result: dict) -> str:
    lines = [
        "# Gradient sync on the emulated cluster, op by op, beside auto's estimate",
        "",
        f"Command: `{result['command']}`",
        "",
        f"{HOSTS} hosts x {DEVICES_PER_HOST} fake CPU devices ({result['machine']}), data 2 x "
        "expert 4, preset tiny, batch 64, as in `experiments/grad_sync_eval.py`. Per link: "
        f"{result['rounds']} timed rounds after {result['warmup']} untimed (the step's median, "
        f"[min-max]), then {TRACED_STEPS} traced steps per algorithm. **measured**: an XLA "
        "op's mean seconds per device per traced step, both processes; **estimated**: auto's "
        f"cost model (op costs: {result['op_costs']}) on the equations the op holds. "
        "**sync**: the ops of the synchronisation (name scopes `grad_reduce`, `param_mix`); "
        "**rest**: the forward and backward passes, the optimizer, the metrics.",
        "",
    ]
    for link, per_link in result["links"].items():
        lines += [f"## {link} Mbit/s", "", f"auto's link: {per_link['estimate_link']}.", ""]
        lines += [
            "| algorithm | step (ms) | traced step (ms) | auto's step (ms) "
            "| sync compute (ms) meas / est | sync collectives (ms) meas / est "
            "| rest compute (ms) meas / est | rest collectives (ms) meas / est |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, row in per_link["algorithms"].items():
            steps = row["step_s"]
            cell = lambda g, groups=row["groups"]: (
                f"{groups.get(g, {}).get('measured', 0) * 1e3:.0f} / "
                f"{groups.get(g, {}).get('estimated', 0) * 1e3:.0f}"
            )
            lines.append(
                f"| {name} | {statistics.median(steps) * 1e3:.0f} [{min(steps) * 1e3:.0f}-"
                f"{max(steps) * 1e3:.0f}] | {row['traced_step_s'] * 1e3:.0f} "
                f"| {row['estimated_step_s'] * 1e3:.0f} | {cell('sync compute')} "
                f"| {cell('sync collective')} | {cell('rest compute')} "
                f"| {cell('rest collective')} |"
            )
        lines.append("")
        for name, row in per_link["algorithms"].items():
            lines += [
                f"{name}: the synchronisation's XLA ops over 1 ms measured, the longest first:",
                "",
                "| XLA op | kind | holds | measured (ms) | estimated (ms) | instruction |",
                "|---|---|---|---|---|---|",
            ]
            for op in row["sync_ops"]:
                if op["measured_s"] < 1e-3:
                    continue
                text = op["text"].replace("|", "/")
                lines.append(
                    f"| {op['op']} | {op['kind']} | {', '.join(op['holds'])} "
                    f"| {op['measured_s'] * 1e3:.1f} | {op['estimated_s'] * 1e3:.1f} "
                    f"| `{text}` |"
                )
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--host"]:
        return host_main(argv[1:])
    args, extra = _parse(argv)
    available, reason = namespaces_available()
    if not available:
        print(f"grad_sync_trace: cannot create network namespaces: {reason}", file=sys.stderr)
        return 2
    from jaxmoe.parallel.host_devices import ensure_host_devices
    from jaxmoe.plan.grad_sync_choice import SYNC_SCOPES

    ensure_host_devices(HOSTS * DEVICES_PER_HOST)  # for auto's estimates, in this process
    algorithms = [a for a in args.algorithms.split(",") if a]
    result = {
        "command": f"sudo .venv/bin/{command_line('experiments.grad_sync_trace', argv)}",
        "machine": machine(),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "op_costs": args.op_costs,
        "links": {},
    }
    with tempfile.TemporaryDirectory(prefix="jaxmoe-grad-sync-trace-") as tmp:
        for link in [float(x) for x in args.links.split(",") if x]:
            try:
                measured = measure(args, extra, link, algorithms, Path(tmp))
            except LinkNotCalibrated:
                return 1
            per_link = {"calibration": measured["calibration"], "algorithms": {}}
            for name in algorithms:
                estimated = estimated_ops(name, link, args.op_costs)
                per_link["estimate_link"] = estimated["link"]
                row = compare(measured["traced"][name], estimated, SYNC_SCOPES)
                row["step_s"] = measured["step_s"][name]
                row["traced_step_s"] = measured["traced"][name]["traced_step_s"]
                row["estimated_step_s"] = sum(op["seconds"] for op in estimated["ops"])
                per_link["algorithms"][name] = row
            result["links"][f"{link:g}"] = per_link
            text = format_markdown(result)
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
            args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
