"""Does XLA:GPU keep the planned windows, and what do they cost? One run on a GPU host.

    python -m experiments.gpu_schedule_check [--preset mixtral-tiny] [--layers 2] \\
        [--schedules none,lancet,pair,pair:free] [--microbatches 2] \\
        [--mock-devices 8 | --aot-devices 8 [--aot-target h100_sxm]] [--steps 10] \\
        [--rounds 5] [--async-min-bytes 0] [--hlo-dir DIR]

For each schedule (its windows pinned by barriers, ``schedule.xla_pin barriers``, and
compiled twice with as many collectives in flight as its plan has, the second time with
each window's latency, :mod:`scheduling.runtime.xla_latencies`; with modifiers:
``NAME:free`` not pinned, ``xla_pin none``; ``NAME:noprofile`` compiled once, without
those latencies, ``xla_latencies false``; ``NAME:groups`` pinned as scheduling groups,
the research option ``scheduling.ExperimentalOptions(xla_groups=True)``; ``NAME:sync``
each collective emitted synchronously at its scheduled start, ``schedule.transport
sync``, its split left to XLA; ``pair:sync:free`` combines them): schedule the preset's
train step, compile it with the scheduler flags
(:data:`scheduling.names.XLA_GPU_FLAGS`) and read the compiled order back from the
optimized HLO:

- **windows kept**: the planned windows (marked in the program, pinned or not) whose
  start comes first, done last, the planned computation between
  (:func:`scheduling.broken_windows`); **their instructions inside**: of the
  instructions marked with a window, those the compiled order runs inside it;
- **all-to-alls overlapped**: of the compiled module's async all-to-alls, those with
  computation between start and done (:func:`scheduling.async_pairs`); a pair with none
  is one XLA runs synchronously.

Then the steps are timed: the schedules run round-robin, ``--steps`` steps each per
round, so that every ratio to ``none`` is of two measurements taken side by side.

``--aot-devices N`` compiles for N GPUs of the attached kind in one node without running
them (an ahead-of-time topology): the compiled order of the multi-GPU step, no times;
with ``--aot-target`` (a GPU model's description) it needs no GPU at all, only XLA's
GPU plugin for this JAX (:mod:`experiments.shared.gpu_devices`).
``--mock-devices N`` compiles and runs for N GPUs on one (JAX's mock GPU topology, one
device per mocked host): only this process's device computes and its collectives move no
data, so the times measure the schedule's computation, not hidden communication. Without
either the mesh is the visible GPUs (:mod:`experiments.shared.gpu_devices`). Refuses to
run on CPU devices (but for an ``--aot-target`` topology): there XLA runs async pairs
synchronously and its HLO order says nothing about the GPU scheduler. Writes ``--out``
(markdown) and a JSON beside it; ``--hlo-dir`` keeps each optimized module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios
from experiments.shared.token_batches import random_token_batches
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results" / "gpu_schedule_check.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mixtral-tiny")
    parser.add_argument("--layers", type=int, default=None, help="model.num_layers")
    parser.add_argument("--schedules", default="none,lancet,pair,pair:free")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--profile", default="h100-8x-nvlink-3200g", help="cost model profile")
    parser.add_argument(
        "--link-mbit", type=float, default=0.0, help="the cost model's link (0: the profile's)"
    )
    parser.add_argument(
        "--async-min-bytes",
        type=int,
        default=0,
        help="schedule.async_min_bytes: smaller collectives stay synchronous (no window)",
    )
    parser.add_argument("--expert", type=int, default=None, help="expert-parallel size")
    parser.add_argument("--data", type=int, default=None, help="data-parallel size")
    parser.add_argument("--mock-devices", type=int, default=0, help="JAX's mock GPU topology")
    parser.add_argument(
        "--aot-devices", type=int, default=0, help="compile for N GPUs of this kind, not run"
    )
    parser.add_argument(
        "--aot-target", default=None, help="with --aot-devices: a GPU model's description"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hlo-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--any-backend", action="store_true", help="run where no GPU is (to try the script)"
    )
    args = parser.parse_args(argv)

    if args.mock_devices and args.aot_devices:
        parser.error("--mock-devices and --aot-devices: choose one")
    if args.aot_target and not args.aot_devices:
        parser.error("--aot-target describes the GPUs of --aot-devices: give both")
    from experiments.shared import gpu_devices

    args.aot_target = args.aot_target and gpu_devices.target_file(args.aot_target)

    gpu_devices.configure(mock=args.mock_devices)

    import jax

    if jax.devices()[0].platform != "gpu" and not (args.any_backend or args.aot_target):
        print("gpu_schedule_check needs GPUs: found only", jax.devices()[0].platform)
        return 2

    devices = gpu_devices.devices(aot=args.aot_devices, target=args.aot_target)
    config = _config(args, len(devices))

    def write(results: dict[str, dict]) -> str:
        text = _report(config, args, results, argv, devices)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        return text

    print(write(_measure(config, args, write, devices)))
    return 0


def _config(args: argparse.Namespace, devices: int):
    from experiments.emulation.experimental import link_profile
    from jaxmoe.presets import preset

    config = preset(args.preset)
    expert = args.expert or min(devices, config.moe.num_experts)
    data = args.data or devices // expert
    model = config.model
    if args.layers:
        model = dataclasses.replace(model, num_layers=args.layers)
    return dataclasses.replace(
        config,
        model=model,
        parallel=dataclasses.replace(config.parallel, data=data, expert=expert),
        train=dataclasses.replace(config.train, microbatches=args.microbatches),
        schedule=dataclasses.replace(
            config.schedule,
            profile=link_profile(args.profile, args.link_mbit) if args.link_mbit else args.profile,
            async_min_bytes=args.async_min_bytes,
        ),
    )


_MODIFIERS = {
    "free": dict(xla_pin="none"),
    "noprofile": dict(xla_latencies=False),
    "groups": dict(xla_groups=True),  # a research option, not a schedule field
    "sync": dict(transport="sync"),
}


def _variant(config, name: str):
    """The configuration of schedule variant ``name``, and its research options (None)."""
    import scheduling

    schedule, *modifiers = name.split(":")
    fields = dict(name=schedule)
    for modifier in modifiers:
        if modifier not in _MODIFIERS:
            raise SystemExit(
                f"--schedules: {name!r}: a schedule name, then any of "
                f"{', '.join(':' + m for m in _MODIFIERS)}"
            )
        fields.update(_MODIFIERS[modifier])
    groups = fields.pop("xla_groups", False)
    experimental = scheduling.ExperimentalOptions(xla_groups=True) if groups else None
    section = dataclasses.replace(config.schedule, **fields)
    return dataclasses.replace(config, schedule=section), experimental


def _measure(config, args: argparse.Namespace, write, devices) -> dict[str, dict]:
    """Compile and read every schedule (``write`` keeps what is known so far), then time
    them where the devices run (not for an ahead-of-time topology)."""

    import scheduling
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.scheduled import scheduled_train_step

    mesh = build_mesh(config.parallel, devices)
    steps, results = {}, {}
    for name in args.schedules.split(","):
        result = results[name] = {"seconds": []}
        try:
            began = time.perf_counter()
            variant, options = _variant(config, name)
            planned = scheduled_train_step(resolve(variant, mesh), options)
            planned_at = time.perf_counter()
            compiled = planned.compile()
            result["plan_s"] = planned_at - began
            result["compile_s"] = time.perf_counter() - planned_at
        except Exception as error:  # a schedule XLA refuses is a finding, not a crash
            result["error"] = "".join(traceback.format_exception_only(error)).strip()[:2000]
            print(f"{name}: {result['error']}", flush=True)
            continue
        text = compiled.as_text()
        if args.hlo_dir:
            args.hlo_dir.mkdir(parents=True, exist_ok=True)
            (args.hlo_dir / f"{name.replace(':', '_')}.hlo.txt").write_text(text)
        windows = scheduling.hlo_windows(text)
        all_to_alls = [p for p in scheduling.async_pairs(text) if p.kind == "all-to-all"]
        # A scheduled step says how its windows were pinned; the plain jit has none.
        kept = compiled.windows() if hasattr(compiled, "windows") else None
        result.update(
            pinned=kept.pinned if kept else "",
            withheld=kept.withheld if kept else None,
            broken=[
                {**dataclasses.asdict(w), "why": w.why} for w in windows.values() if not w.kept
            ],
            groups=len(windows),
            kept=kept.kept if kept else 0,
            planned=kept.scheduled if kept else 0,
            placed=kept.placed if kept else 0,
            all_to_alls=len(all_to_alls),
            overlapped=sum(p.overlapped for p in all_to_alls),
        )
        steps[name] = compiled
        print(name, {k: v for k, v in result.items() if k not in ("seconds", "broken")}, flush=True)
    write(results)
    if args.aot_devices:
        return results
    try:
        _time(config, mesh, steps, results, args)
    except Exception as error:
        message = "".join(traceback.format_exception_only(error)).strip()[:2000]
        for name in steps:
            results[name]["run_error"] = message
        print("timing:", message, flush=True)
    return results


def _time(config, mesh, steps, results, args) -> None:
    import jax

    from jaxmoe.train.state import init_train_state

    batches = random_token_batches(config, mesh, args.steps)
    state = init_train_state(resolve(config, mesh))
    for step in steps.values():  # warm up each, outside the timed rounds
        state, metrics = step(state, batches[0])
        jax.block_until_ready(metrics)
    for _ in range(args.rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            for batch in batches:
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            results[name]["seconds"].append((time.perf_counter() - started) / len(batches))


def _report(config, args, results: dict[str, dict], argv, devices) -> str:
    import jax

    from experiments.shared import gpu_devices

    command = command_line("experiments.gpu_schedule_check", sys.argv[1:] if argv is None else argv)
    tokens = config.train.batch_size * config.model.seq_len
    baseline = results.get("none", {}).get("seconds")
    described = gpu_devices.describe(
        devices, mock=args.mock_devices, aot=args.aot_devices, target=args.aot_target
    )
    timed = f"{args.rounds} rounds of {args.steps} steps."
    lines = [
        "# Planned windows on XLA:GPU",
        "",
        f"Command: `{command}`",
        "",
        f"{described}, jax {jax.__version__}, XLA flags `{os.environ.get('XLA_FLAGS', '')}`; "
        f"preset `{args.preset}` ({config.model.num_layers} layers) on data "
        f"{config.parallel.data} x expert {config.parallel.expert}, "
        f"{config.train.microbatches} microbatches, cost profile {args.profile}"
        + (f" with a {args.link_mbit:g} Mbit/s link" if args.link_mbit else "")
        + (
            f", collectives under {args.async_min_bytes} bytes synchronous"
            if args.async_min_bytes
            else ""
        )
        + "; "
        + (timed if not args.aot_devices else "compiled only."),
        "",
        "| schedule | pinning | windows kept | their instructions inside | all-to-alls "
        "overlapped | compile s | step ms, median [range] | tokens/s | / none [range] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, result in results.items():
        if "error" in result:
            lines.append(f"| {name} | | compile failed | | | | | | |")
            notes.append(f"- `{name}` did not compile: `{result['error'].splitlines()[0]}`")
            continue
        kept = f"{result['kept']} of {result['groups']}"
        inside = f"{result['placed']} of {result['planned']}" if result["planned"] else "-"
        if result.get("withheld"):
            kept = "not emitted"
        overlapped = f"{result['overlapped']} of {result['all_to_alls']}"
        step = tokens_per_s = ratio = "-"
        if result["seconds"]:
            spread = Spread.of(result["seconds"])
            step, tokens_per_s = spread.format(), f"{tokens / spread.median:,.0f}"
            if baseline and name != "none":
                ratios = round_ratios(baseline, result["seconds"])
                ratio = Spread.of(ratios).format(scale=1, digits=2)
        elif "run_error" in result:
            step = "did not run"
        if result["broken"]:
            shown = "; ".join(
                f"{w['group']} ({w['why']}; start at {w['start']}, done at {w['done']})"
                for w in result["broken"][:4]
            )
            notes.append(f"- `{name}`: windows not kept (position in the entry): {shown}")
        lines.append(
            f"| {name} | {result['pinned'] or '-'} | {kept} | {inside} | {overlapped} | "
            f"{result['compile_s']:.1f} | {step} | {tokens_per_s} | {ratio} |"
        )
    withheld = {r["withheld"] for r in results.values() if r.get("withheld")}
    notes += [f"- no scheduling groups were emitted: {reason}" for reason in withheld]
    errors = {r["run_error"] for r in results.values() if "run_error" in r}
    notes += [f"- the steps did not run: `{e.splitlines()[0]}`" for e in errors]
    return "\n".join([*lines, "", *notes, ""])


if __name__ == "__main__":
    sys.exit(main())
