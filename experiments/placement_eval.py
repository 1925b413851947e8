"""Static against dynamic expert placement at equal per-device buffers, on real routing.

    python -m experiments.placement_eval [--tiny-steps 300] [--small-steps 100]

Trains on the byte corpus, in this process on 8 fake CPU devices, each preset
twice with the same slots per device and the same capacity per slot: *static*
(the replica slots give every expert the same number of copies and never change)
and *dynamic* (``moe.rebalance_every``: the planner moves the copies to the load).
Reports the dropped fraction over training, the loss at equal steps, and the
issue's target (``tiny``, capacity factor 1.25, 300 steps: dynamic drops at most
half as many assignments as static over the last half). Then, on ``tiny``, short
runs at larger capacity factors for the factor each placement needs to drop at
most 1%, and, from the static run's ``kept_by_copies``, the drops static
placement would have had on the same routing at every multiple of its per-copy
capacity. Writes ``experiments/results/placement_eval.md`` and
``placement_eval.png`` (per-expert load and copies over the dynamic ``tiny`` run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
SWEEP_FACTORS = (2.5, 5.0)


def _config(name: str, steps: int, slots: int, rebalance: int, capacity_factor: float | None):
    from jaxmoe.presets import preset

    base = preset(name)
    moe = dataclasses.replace(
        base.moe,
        slots_per_device=slots,
        rebalance_every=rebalance,
        capacity_factor=base.moe.capacity_factor if capacity_factor is None else capacity_factor,
    )
    train = dataclasses.replace(
        base.train, steps=steps, checkpoint_every=0, eval_every=steps, eval_batches=4
    )
    return dataclasses.replace(base, moe=moe, train=train)


def _run(config, experimental=None) -> tuple[list[dict], list[dict], float]:
    """Train ``config`` (with the research options ``experimental``, None: the library's):
    its metrics, its placement decisions and its seconds."""
    from jaxmoe.experimental import DEFAULT
    from jaxmoe.prepare import prepare_run
    from jaxmoe.train.loop import train

    experimental = DEFAULT if experimental is None else experimental
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        rows = train(prepare_run(config, experimental=experimental), scratch, progress=False)
        seconds = time.perf_counter() - started
        log = Path(scratch) / "placement.jsonl"
        decisions = (
            [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        )
    return rows, decisions, seconds


def _dropped(rows: list[dict]) -> float:
    """Assignments dropped over ``rows`` as a fraction of those made (every step has as many)."""
    return float(np.mean([row["dropped_fraction"] for row in rows]))


def _buckets(rows: list[dict], count: int = 5) -> list[float]:
    return [_dropped(list(part)) for part in np.array_split(np.asarray(rows, object), count)]


def _static_drop_curve(rows: list[dict], config) -> list[tuple[float, float]]:
    """(capacity factor, dropped fraction) that static placement would have had on the routing
    of ``rows`` with m places per expert-copy unit, m = 1..max: from ``kept_by_copies``."""
    kept = np.mean([row["kept_by_copies"] for row in rows], axis=0).sum(axis=(0, 1))  # [copies]
    routed = np.mean([np.sum(row["tokens_per_expert"]) for row in rows])
    slots = config.parallel.expert * config.moe.slots_per_device
    from jaxmoe.config import capacity_per_expert

    capacity = capacity_per_expert(
        config.group_size, config.moe.top_k, config.moe.capacity_factor, slots
    )
    unit = config.moe.num_experts / (config.group_size * config.moe.top_k)
    return [(m * capacity * unit, 1 - k / routed) for m, k in enumerate(kept, start=1)]


def _replayed_drops(rows: list[dict], config, hindsight: bool) -> list[float]:
    """Dropped fraction per step of the planner replayed on the routing of a static run's
    ``rows``: ``kept_by_copies`` gives what every expert keeps with any number of copies,
    and routing does not depend on the placement, so this is what that routing would have
    dropped under the planner's tables. ``hindsight``: each window planned from its own
    routing (the best the planner could do knowing the window in advance)."""
    from jaxmoe.placement.planner import plan_placement
    from jaxmoe.placement.replicas import replicas_per_expert
    from jaxmoe.train.state import initial_placement

    every = config.moe.rebalance_every
    table = np.asarray(initial_placement(config))
    drops = []
    for index, row in enumerate(rows):
        if index % every == 0 and (hindsight or index):
            window = rows[index : index + every] if hindsight else rows[index - every : index]
            table, _ = plan_placement(table, window, config, index)
        kept = np.asarray(row["kept_by_copies"])  # [layers, experts, copies]
        copies = np.minimum(replicas_per_expert(table, config.moe.num_experts), kept.shape[2])
        total = np.take_along_axis(kept, copies[..., None] - 1, axis=2).sum()
        drops.append(1 - total / np.sum(row["tokens_per_expert"]))
    return drops


def _plot(rows: list[dict], static_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [row["step"] for row in rows]
    load = np.asarray([row["tokens_per_expert"][0] for row in rows])
    copies = np.asarray([row["replicas_per_expert"][0] for row in rows])
    figure, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for expert in range(load.shape[1]):
        line = axes[0].plot(steps, load[:, expert], lw=0.8, label=f"expert {expert}")
        axes[1].step(
            steps,
            copies[:, expert] + 0.04 * expert,
            where="post",
            lw=1.0,
            color=line[0].get_color(),
        )
    axes[0].set_ylabel("assignments routed\n(first MoE layer)")
    axes[0].legend(ncol=4, fontsize=7)
    axes[1].set_ylabel("copies (offset per expert)")
    axes[2].plot(steps, [r["dropped_fraction"] for r in static_rows], label="static", lw=0.8)
    axes[2].plot(steps, [r["dropped_fraction"] for r in rows], label="dynamic", lw=0.8)
    axes[2].set_ylabel("dropped fraction")
    axes[2].set_xlabel("step")
    axes[2].legend()
    figure.suptitle("tiny, capacity factor 1.25, 2 slots per device: dynamic placement")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-steps", type=int, default=300)
    parser.add_argument("--small-steps", type=int, default=100)
    parser.add_argument("--sweep-steps", type=int, default=60)
    parser.add_argument("--rebalance-every", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "placement_eval.md")
    args = parser.parse_args(argv)

    from jaxmoe.parallel.host_devices import ensure_host_devices

    ensure_host_devices(8)
    every = args.rebalance_every
    lines = [
        "# Static against dynamic expert placement (equal per-device buffers)",
        "",
        f"Command: `python -m experiments.placement_eval --tiny-steps {args.tiny_steps} "
        f"--small-steps {args.small_steps} --sweep-steps {args.sweep_steps} "
        f"--rebalance-every {every}`",
        f"Host: {platform.machine()}, {platform.python_version()}, 8 fake CPU devices. "
        "Byte corpus (the Python standard library's sources). Both placements have the same "
        "slots per device and the same capacity per slot; static gives every expert the "
        f"same number of copies, dynamic re-plans every {every} steps.",
        "",
    ]
    results = {}
    for name, steps, slots in (("tiny", args.tiny_steps, 2), ("small", args.small_steps, 8)):
        runs = {}
        for label, rebalance in (("static", 0), ("dynamic", every)):
            config = _config(name, steps, slots, rebalance, None)
            rows, decisions, seconds = _run(config)
            runs[label] = (rows, decisions, config)
            print(f"{name} {label}: {seconds:.0f} s, dropped {_dropped(rows):.3f}", flush=True)
        results[name] = runs
        static, dynamic = runs["static"][0], runs["dynamic"][0]
        config = runs["static"][2]
        half = steps // 2
        ratio = _dropped(dynamic[half:]) / _dropped(static[half:])
        applied = [d for d in runs["dynamic"][1] if d.get("applied")]
        lines += [
            f"## `{name}`: {steps} steps, capacity factor {config.moe.capacity_factor}, "
            f"{slots} slots per device ({config.moe.num_experts // config.parallel.expert} "
            f"experts per device), layout {config.parallel.data} x {config.parallel.expert}",
            "",
            "| | static | dynamic |",
            "|---|---|---|",
            "| dropped fraction, each fifth of the run | "
            + " / ".join(f"{x:.3f}" for x in _buckets(static))
            + " | "
            + " / ".join(f"{x:.3f}" for x in _buckets(dynamic))
            + " |",
            f"| dropped fraction, last half | {_dropped(static[half:]):.4f} | "
            f"{_dropped(dynamic[half:]):.4f} |",
            f"| loss, mean of the last 20 steps | {np.mean([r['loss'] for r in static[-20:]]):.4f}"
            f" | {np.mean([r['loss'] for r in dynamic[-20:]]):.4f} |",
            f"| val_loss at the end | {static[-1]['val_loss']:.4f} | "
            f"{dynamic[-1]['val_loss']:.4f} |",
            "",
            f"Dynamic/static dropped assignments over the last half: **{ratio:.3f}**; "
            f"{len(applied)} planner changes applied "
            f"({sum(d['change'] == 'move' for d in applied)} moves).",
            "",
        ]
        replay_config = dataclasses.replace(
            config, moe=dataclasses.replace(config.moe, rebalance_every=every)
        )
        planned = _replayed_drops(static, replay_config, hindsight=False)
        best = _replayed_drops(static, replay_config, hindsight=True)
        lines += [
            "Replayed on the static run's routing (exact: `kept_by_copies`), dropped fraction "
            f"over the last half: static {_dropped(static[half:]):.4f}, the planner "
            f"{np.mean(planned[half:]):.4f}, the planner with hindsight (each window planned "
            f"from its own routing) {np.mean(best[half:]):.4f}.",
            "",
        ]

    tiny_static = results["tiny"]["static"]
    lines += [
        "## Capacity factor for at most 1% drops (`tiny`)",
        "",
        f"Short runs of {args.sweep_steps} steps; dropped fraction over their last half.",
        "",
        "| capacity factor | static | dynamic |",
        "|---|---|---|",
    ]
    for factor in SWEEP_FACTORS:
        cells = []
        for rebalance in (0, every):
            config = _config("tiny", args.sweep_steps, 2, rebalance, factor)
            rows, _, seconds = _run(config)
            cells.append(_dropped(rows[args.sweep_steps // 2 :]))
            print(f"sweep {factor} rebalance {rebalance}: {seconds:.0f} s", flush=True)
        lines.append(f"| {factor} | {cells[0]:.4f} | {cells[1]:.4f} |")
    curve = _static_drop_curve(tiny_static[0][len(tiny_static[0]) // 2 :], tiny_static[2])
    lines += [
        "",
        "Static placement on the routing of the 300-step static run's last half, at every "
        "multiple of its per-copy capacity (exact, from `kept_by_copies`: an expert keeps its "
        "first places-per-expert assignments of each group):",
        "",
        "| capacity factor | " + " | ".join(f"{f:.2f}" for f, _ in curve) + " |",
        "|---|" + "---|" * len(curve),
        "| dropped | " + " | ".join(f"{d:.4f}" for _, d in curve) + " |",
        "",
    ]
    png = args.out.with_suffix(".png")
    _plot(results["tiny"]["dynamic"][0], tiny_static[0], png)
    lines += [f"![per-expert load and copies]({png.name})", ""]
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
