"""The Lancet evaluation, reproduced: emulated cluster at laptop scale, simulator at paper scale.

(a) Emulated cluster (real steps), in the regime of ``experiments.emulation.overlap_regime``:
    ``tiny`` with top-2 and 128 sequences per step on 2 hosts x 1 device over a
    calibrated 50 Mbit/s link, every all-to-all over the socket transport (``none``
    synchronously), with the overlap control beside the schedules. Schedules ``none``,
    ``async`` (the Tutel-style baseline at degree 1), ``partition`` and ``lancet``, in
    interleaved rounds; one run per rate of ``--links`` (default 50), or ``--cluster-json
    FILE`` (repeatable) takes saved runs of that regime (``experiments.cluster --json``,
    ``experiments.simulator_validation --keep``).
(b) Simulator (cost model and two-stream timeline): Lancet's GPT-2 MoE, 12 layers of
    width 768 and 24 of width 1024, 16 heads, sequence 512, MoE every second layer,
    experts = 2 x GPUs, capacity factor 1.0, top-1, 8 sequences per GPU, on 16 and 32
    GPUs of the 8xA100 (400 Gbit/s) and 8xV100 (100 Gbit/s) profiles.

Writes ``experiments/results/lancet_eval.md`` and ``lancet_eval.png``. ``--quick`` runs a
small version: 3 rounds, no runs on the unshaped link (so no exposed communication for
(a)), one model, 16 GPUs. ``--skip-cluster`` leaves out (a), which needs root for network
namespaces, and keeps the (a) section of the results file it overwrites; ``--skip-simulator``
keeps (b) and what follows it.

Each simulated row also gives the ideal step: the simulator's lower bound for any
schedule of that program, max(compute, communication) of the unpartitioned program
(each stream busy the whole step, every collective hidden; partitioning only adds
launches, cuts, joins and latencies), and the speedup over ``none`` it allows. Where
that bound is under 1.3x, the table says 1.3x is out of reach.

    python -m experiments.lancet_eval [--quick] [--links 50,200 | --cluster-json FILE ...]
        [--skip-cluster] [--skip-simulator]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from experiments.shared.device_process import call_with_devices
from experiments.shared.results_file import command_line, kept_section
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results"
PROFILES = ("a100-8x-nvlink-400g", "v100-8x-nvlink-100g")
# Name in the tables -> (policy, chunk count). Degree 1 of the Tutel-style baseline is the
# step with every collective async and nothing pipelined.
SCHEDULES = {
    "none": ("none", None),
    "dw": ("dw", None),
    "partition": ("partition", None),
    "lancet": ("lancet", None),
    "tutel-1": ("async", None),
    "tutel-2": ("expert_pipeline", 2),
    "tutel-4": ("expert_pipeline", 4),
    "tutel-8": ("expert_pipeline", 8),
}
MODELS = {"gpt2-moe-12 (12 x 768)": (12, 768), "gpt2-moe-24 (24 x 1024)": (24, 1024)}


def paper_config(layers: int, width: int, gpus: int):
    from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig

    return Config(
        model=ModelConfig(
            vocab_size=50257,
            d_model=width,
            num_heads=16,
            num_layers=layers,
            d_ff=4 * width,
            seq_len=512,
            moe_every=2,
        ),
        moe=MoEConfig(num_experts=2 * gpus, top_k=1, capacity_factor=1.0),
        parallel=ParallelConfig(data=1, expert=gpus),
        train=TrainConfig(batch_size=8 * gpus),
    )


def simulate(gpus: int, models: list[str]) -> list[dict]:
    """Rows of (b) for ``gpus`` devices; runs in a process with that many fake devices
    (``call_with_devices``)."""
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.scheduled import capture_train_step
    from scheduling import SchedulePolicy, batch_inputs, build_report, cost_model, schedule

    rows = []
    for model in models:
        config = paper_config(*MODELS[model], gpus)
        mesh = build_mesh(config.parallel)
        program, sharded = capture_train_step(resolve(config, mesh))
        batch = batch_inputs(program, sharded.batch_argnums)
        for profile in PROFILES:
            for label, (name, chunks) in SCHEDULES.items():
                policy = SchedulePolicy(name=name, profile=profile, partition_chunks=chunks)
                cost = cost_model(policy, mesh)
                report = build_report(schedule(program, policy, cost, batch), cost, policy, program)
                exchanges = [c for c in report.collectives if c.kind == "all_to_all"]
                rows.append(
                    {
                        "instrument": "simulator",
                        "config": f"{model}, {gpus} GPUs, {profile}",
                        "schedule": label,
                        "step_s": report.step_seconds,
                        "compute_s": report.compute_seconds,
                        "communication_s": report.communication_seconds,
                        "exposed_s": report.exposed_communication_seconds,
                        "all_to_all_s": sum(c.estimated_seconds for c in exchanges),
                        "all_to_all_exposed_s": sum(
                            c.estimated_seconds - c.overlap_seconds for c in exchanges
                        ),
                        "partitions": [p.chunks for p in report.partitions],
                        "ideal_s": report.ideal_step_seconds,
                    }
                )
                print(f"  {rows[-1]['config']} {label}: {report.step_seconds * 1e3:.2f} ms")
    return rows


def cluster(quick: bool, link_mbit: float, saved: Path | None = None) -> list[str]:
    """One part of section (a): an emulated-cluster run of the regime on a ``link_mbit``
    link (or a saved run), its table with per-round speedups over ``none``, its calibration
    and its control."""
    from experiments.emulation import overlap_regime as regime
    from experiments.emulation.schedule_runs import format_table, measure_schedules

    if saved is None:
        request = regime.request(link_mbit=link_mbit, quick=quick)
        report = measure_schedules(request, request.command("cluster.json")).to_json()
    else:
        report = json.loads(saved.read_text())
    command = report["command"]
    shaped_only = " (shaped link only)" if "--shaped-only" in command else ""
    return [
        f"### {regime.label(report['link_mbit'])}{shaped_only}",
        "",
        f"`{command}`",
        "",
        regime.summary(report),
        "",
        format_table(report),
        "",
    ]


TARGET_SPEEDUP = 1.3


def _table(rows: list[dict]) -> list[str]:
    """One line per row. Rows with an ``ideal_s`` (the simulator's) also get the ideal
    step and the speedup it bounds (see ``ScheduleReport.ideal_step_seconds``)."""
    with_ideal = all("ideal_s" in row for row in rows)
    ideal_header = " ideal step (ms) | speedup bound (none / ideal) |" if with_ideal else ""
    lines = [
        "| configuration | schedule | step (ms) | exposed communication (ms) | "
        "exposed all-to-all (ms) | reduction of exposed all-to-all vs none | speedup vs none "
        f"|{ideal_header} step / max(compute, communication) |",
        "|---|---|---|---|---|---|---|" + ("---|---|" if with_ideal else "") + "---|",
    ]
    baseline = {r["config"]: r for r in rows if r["schedule"] == "none"}
    for row in rows:
        none = baseline[row["config"]]
        bound = max(row["compute_s"], row["communication_s"])
        if "all_to_all_exposed_s" in row:
            a2a = f"{row['all_to_all_exposed_s'] * 1e3:.2f}"
            reduction = 1 - row["all_to_all_exposed_s"] / none["all_to_all_exposed_s"]
            reduction_text = f"{reduction:.0%}".replace("-0%", "0%")
        else:
            a2a = reduction_text = "n/a"
        # Not measured (the cluster's --shaped-only runs): no compute-only, so no exposed
        # communication and no bound.
        exposed = "n/a" if math.isnan(row["exposed_s"]) else f"{row['exposed_s'] * 1e3:.2f}"
        ratio = "n/a" if math.isnan(bound) else f"{row['step_s'] / bound:.2f}"
        ideal = ""
        if with_ideal:
            best = none["step_s"] / row["ideal_s"]
            reach = "" if best >= TARGET_SPEEDUP else f", {TARGET_SPEEDUP}x out of reach"
            ideal = f" {row['ideal_s'] * 1e3:.2f} | {best:.3f}x{reach} |"
        lines.append(
            f"| {row['config']} | {row['schedule']} | {row['step_s'] * 1e3:.2f} | "
            f"{exposed} | {a2a} | {reduction_text} | "
            f"{none['step_s'] / row['step_s']:.3f}x |{ideal} {ratio} |"
        )
    return lines


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    labels = list(SCHEDULES)
    figure, axes = plt.subplots(figsize=(max(8, 1.8 * len(configs)), 5))
    width = 0.8 / len(labels)
    for index, label in enumerate(labels):
        speedups = []
        for config in configs:
            none = next(r for r in rows if r["config"] == config and r["schedule"] == "none")
            row = next((r for r in rows if r["config"] == config and r["schedule"] == label), None)
            speedups.append(none["step_s"] / row["step_s"] if row else 0.0)
        axes.bar([c + index * width for c in range(len(configs))], speedups, width, label=label)
    axes.axhline(1.0, color="black", linewidth=0.8)
    names = [config.replace(", ", "\n") for config in configs]
    axes.set_xticks([c + 0.4 - width / 2 for c in range(len(configs))], names, fontsize=7)
    axes.set_ylim(0.8, None)
    axes.set_ylabel("speedup over none")
    axes.legend(ncol=4, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-cluster", action="store_true")
    parser.add_argument(
        "--skip-simulator",
        action="store_true",
        help="keep (b) and what follows it from the results file it overwrites",
    )
    parser.add_argument("--links", default="50", help="(a): link rates in Mbit/s, one run each")
    parser.add_argument(
        "--cluster-json",
        type=Path,
        action="append",
        help="(a) from this saved run of the regime (cluster --json); may be repeated",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "lancet_eval.md")
    args = parser.parse_args(argv)

    command = command_line("experiments.lancet_eval", sys.argv[1:] if argv is None else argv)
    sections = [
        "# Lancet evaluation",
        "",
        f"Command: `{command}`",
        "",
        "(a) is measured on the emulated cluster, (b) is the simulator. Exposed communication",
        "is step minus the same step on an unshaped link in (a), the time the compute stream",
        "waits for collectives in (b). tutel-N pipelines each MoE layer's all-to-alls with its",
        "experts in N chunks (tutel-1: no pipelining, collectives async).",
        "",
    ]
    if not args.skip_cluster:
        sections += [
            "## (a) Emulated cluster",
            "",
            "`async` is the Tutel-style baseline at degree 1 (every collective split, nothing",
            "pipelined).",
            "",
        ]
        if args.cluster_json:
            for saved in args.cluster_json:
                sections += cluster(args.quick, float("nan"), saved)
        else:
            from experiments.emulation.link_calibration import LinkNotCalibrated

            try:
                for link in args.links.split(","):
                    sections += cluster(args.quick, float(link))
            except LinkNotCalibrated:
                return 2
    else:
        sections += kept_section(args.out, "## (a)", "## (b)", "--skip-cluster")
    if args.skip_simulator:
        sections += kept_section(args.out, "## (b)", None, "--skip-simulator")
        args.out.write_text("\n".join(sections))
        print(f"wrote {args.out}")
        return 0
    gpu_counts = (16,) if args.quick else (16, 32)
    models = list(MODELS)[:1] if args.quick else list(MODELS)
    # One process per device count: XLA reads it once, at start.
    simulated = [
        row for gpus in gpu_counts for row in call_with_devices(gpus, simulate, gpus, models)
    ]
    sections += ["## (b) Simulator at paper scale", "", *_table(simulated), ""]
    chosen = sorted({(r["config"], r["schedule"], tuple(r["partitions"])) for r in simulated})
    sections += ["Partitioned ranges chosen (chunks per range):", ""]
    sections += [
        f"- {c}, {s}: {list(p) or 'none'}" for c, s, p in chosen if s in ("partition", "lancet")
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot = args.out.with_suffix(".png")
    _plot(simulated, plot)
    sections += ["", f"![speedup over none, simulator]({plot.name})", ""]
    args.out.write_text("\n".join(sections))
    print(f"wrote {args.out} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
