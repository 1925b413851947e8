"""The COMET evaluation in the simulator: one MoE layer, and the GPT-2 MoE steps end to end.

(a) One MoE layer, forward and backward (the gradients of its parameters and its input
    for a given output cotangent), at shapes after COMET's models (Mixtral-8x7B,
    Phi-3.5-MoE, Qwen2-MoE: width, expert hidden size, experts, top-k), 8192 tokens
    per GPU, capacity factor 1.0, float32 (TF32), expert parallelism over one node of
    8 GPUs and over two nodes (16 GPUs), on the 8xA100 and 8xH100 node profiles.
    Schedules ``none``, the Tutel-style ``expert_pipeline`` at degrees 2, 4, 8, and
    ``comet``; layer time and speedup over ``none``, and comet's choice per exchange.
(b) End to end: Lancet's GPT-2 MoE configurations from ``experiments.lancet_eval`` on
    16 and 32 GPUs of its profiles, with ``none``, ``lancet``, ``comet`` and
    ``lancet+comet`` (the other schedules are in ``lancet_eval.md``).
(c) The emulated cluster (``experiments.comet_cluster``): the overlap regime's step on 2
    hosts over a calibrated link with ``none``, ``async``, ``expert_pipeline:2``,
    ``comet``, ``lancet`` and ``lancet+comet``, measured side by side, and each predicted
    by the simulator from the instrument's description. Needs root (network namespaces);
    ``--cluster-from DIR`` predicts again from a saved run, ``--skip-cluster`` keeps (c).

(a) and (b) are the simulator's (the cost model and the two-stream timeline);
``--skip-simulator`` keeps them from the results file it overwrites.

    python -m experiments.comet_eval [--quick] [--step-gpus 16,32] [--step-models M1;M2]
        [--skip-simulator] [--skip-cluster | --cluster-from DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments import comet_cluster
from experiments.shared.device_process import call_with_devices
from experiments.shared.results_file import command_line, kept_section
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results"
LAYER_PROFILES = ("a100-8x-nvlink-400g", "h100-8x-nvlink-3200g")
# name -> (d_model, expert hidden, experts, top_k)
LAYER_SHAPES = {
    "Mixtral-8x7B": (4096, 14336, 8, 2),
    "Phi-3.5-MoE": (4096, 6400, 16, 2),
    "Qwen2-MoE-57B": (3584, 2560, 64, 8),
}
TOKENS_PER_GPU = (8, 1024)  # sequences x sequence length (one routing group per sequence)
LAYER_SCHEDULES = {
    "none": ("none", None),
    "tutel-2": ("expert_pipeline", 2),
    "tutel-4": ("expert_pipeline", 4),
    "tutel-8": ("expert_pipeline", 8),
    "comet": ("comet", None),
}
STEP_SCHEDULES = ("none", "lancet", "comet", "lancet+comet")


def layer_program(width: int, hidden: int, experts: int, top_k: int, gpus: int):
    """The captured per-device program of one MoE layer's forward and backward pass."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxmoe.config import MoEConfig, ParallelConfig
    from jaxmoe.layers.moe import MoELayer
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.parallel.sharding import param_specs
    from scheduling import capture

    mesh = build_mesh(ParallelConfig(data=1, expert=gpus))
    config = MoEConfig(num_experts=experts, top_k=top_k, capacity_factor=1.0)
    abstract = nnx.eval_shape(
        lambda: MoELayer(width, hidden, config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(abstract)
    params = nnx.to_pure_dict(state)
    specs = param_specs(state)
    tokens = PartitionSpec(("data", "expert"))
    sequences, length = TOKENS_PER_GPU
    x = jax.ShapeDtypeStruct(
        (sequences * gpus, length, width), jnp.float32, sharding=NamedSharding(mesh, tokens)
    )
    params = jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, s)),
        params,
        specs,
    )

    def per_device(params, x, cotangent):
        def loss(params, x):
            layer = nnx.merge(graphdef, params)
            return jnp.sum(layer.per_device(x)[0] * cotangent)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    program = capture(
        per_device,
        params,
        x,
        x,
        mesh=mesh,
        in_specs=(specs, tokens, tokens),
        out_specs=(specs, tokens),
    )
    return program, mesh


def simulate_layers(gpus: int, quick: bool) -> list[dict]:
    """Rows of (a) for ``gpus`` devices; runs in a process with that many fake devices."""
    from scheduling import SchedulePolicy, build_report, cost_model, schedule

    rows = []
    shapes = list(LAYER_SHAPES)[:1] if quick else list(LAYER_SHAPES)
    for name in shapes:
        width, hidden, experts, top_k = LAYER_SHAPES[name]
        if experts % gpus:
            continue
        program, mesh = layer_program(width, hidden, experts, top_k, gpus)
        batch = [program.inputs[-2]]  # the layer's input: its leading axis is the batch
        for profile in LAYER_PROFILES:
            for label, (policy_name, chunks) in LAYER_SCHEDULES.items():
                policy = SchedulePolicy(name=policy_name, profile=profile, partition_chunks=chunks)
                cost = cost_model(policy, mesh)
                scheduled = schedule(program, policy, cost, batch)
                report = build_report(scheduled, cost, policy, program)
                seconds = report.baseline_step_seconds if label == "none" else report.step_seconds
                rows.append(
                    {
                        "config": f"{name}, {gpus} GPUs, {profile}",
                        "schedule": label,
                        "layer_s": seconds,
                        "compute_s": report.compute_seconds,
                        "communication_s": report.communication_seconds,
                        "ideal_s": report.ideal_step_seconds,
                        "exchanges": [
                            f"{x.decomposition} (gain {x.estimated_gain_seconds * 1e3:.3f} ms"
                            + (f"; {x.why})" if x.why else ")")
                            for x in report.exchanges
                        ],
                    }
                )
                print(f"  {rows[-1]['config']} {label}: {seconds * 1e3:.3f} ms", flush=True)
    return rows


def simulate_steps(gpus: int, models: list[str]) -> list[dict]:
    """Rows of (b) for ``gpus`` devices."""
    from experiments.lancet_eval import MODELS, PROFILES, paper_config
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
            for name in STEP_SCHEDULES:
                policy = SchedulePolicy(name=name, profile=profile)
                cost = cost_model(policy, mesh)
                report = build_report(schedule(program, policy, cost, batch), cost, policy, program)
                seconds = report.baseline_step_seconds if name == "none" else report.step_seconds
                rows.append(
                    {
                        "config": f"{model}, {gpus} GPUs, {profile}",
                        "schedule": name,
                        "step_s": seconds,
                        "ideal_s": report.ideal_step_seconds,
                        "partitions": [p.chunks for p in report.partitions],
                        "exchanges": [f"{x.layer} {x.decomposition}" for x in report.exchanges],
                    }
                )
                print(f"  {rows[-1]['config']} {name}: {seconds * 1e3:.2f} ms", flush=True)
    return rows


def _layer_table(rows: list[dict]) -> list[str]:
    lines = [
        "| configuration | schedule | layer fwd+bwd (ms) | speedup vs none | "
        "ideal (ms) | speedup bound |",
        "|---|---|---|---|---|---|",
    ]
    none = {r["config"]: r["layer_s"] for r in rows if r["schedule"] == "none"}
    for r in rows:
        base = none[r["config"]]
        lines.append(
            f"| {r['config']} | {r['schedule']} | {r['layer_s'] * 1e3:.3f} | "
            f"{base / r['layer_s']:.3f}x | {r['ideal_s'] * 1e3:.3f} | "
            f"{base / r['ideal_s']:.3f}x |"
        )
    return lines


def _step_table(rows: list[dict]) -> list[str]:
    lines = [
        "| configuration | schedule | step (ms) | speedup vs none | speedup bound |",
        "|---|---|---|---|---|",
    ]
    none = {r["config"]: r["step_s"] for r in rows if r["schedule"] == "none"}
    for r in rows:
        base = none[r["config"]]
        lines.append(
            f"| {r['config']} | {r['schedule']} | {r['step_s'] * 1e3:.2f} | "
            f"{base / r['step_s']:.3f}x | {base / r['ideal_s']:.3f}x |"
        )
    return lines


def _targets(layers: list[dict], steps: list[dict]) -> list[str]:
    """The issue's targets, each read off the rows above."""

    def by(rows, key):
        table: dict[str, dict[str, float]] = {}
        for r in rows:
            table.setdefault(r["config"], {})[r["schedule"]] = r[key]
        return table

    lines = []
    for config, times in by(layers, "layer_s").items():
        comet, none = times["comet"], times["none"]
        best_tutel = min((v, k) for k, v in times.items() if k.startswith("tutel"))
        lines.append(
            f"- {config}: comet {none / comet:.3f}x over none "
            f"({'meets' if none / comet >= 1.5 else 'misses'} 1.5x); "
            f"best Tutel-style {best_tutel[1]} {none / best_tutel[0]:.3f}x: comet "
            f"{'beats' if comet < best_tutel[0] else 'does not beat'} it"
        )
    for config, times in by(steps, "step_s").items():
        both, alone = times["lancet+comet"], min(times["lancet"], times["comet"])
        lines.append(
            f"- {config}: lancet+comet {times['none'] / both:.3f}x, lancet "
            f"{times['none'] / times['lancet']:.3f}x, comet {times['none'] / times['comet']:.3f}x"
            f": lancet+comet {'never slower' if both <= alone * (1 + 1e-9) else 'SLOWER'} than "
            "either alone"
        )
    return lines


def _simulated(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Sections (a) and (b), and the targets read off them."""
    from experiments.lancet_eval import MODELS

    # One process per device count: XLA reads it once, at start.
    layers = [
        row
        for gpus in ((8,) if args.quick else (8, 16))
        for row in call_with_devices(gpus, simulate_layers, gpus, args.quick)
    ]
    models = list(MODELS)[:1] if args.quick else list(MODELS)
    models = args.step_models.split(";") if args.step_models else models
    gpu_counts = (16,) if args.quick else tuple(int(g) for g in args.step_gpus.split(","))
    steps = [
        row for gpus in gpu_counts for row in call_with_devices(gpus, simulate_steps, gpus, models)
    ]
    simulated = [
        "## (a) One MoE layer, forward and backward",
        "",
        f"{TOKENS_PER_GPU[0]} x {TOKENS_PER_GPU[1]} tokens per GPU, capacity factor 1.0, float32.",
        "Shapes (width, expert hidden, experts, top-k): "
        + "; ".join(f"{k} {v}" for k, v in LAYER_SHAPES.items())
        + ".",
        "",
        *_layer_table(layers),
        "",
        "comet's choice per MoE layer (forward and backward together):",
        "",
        *sorted(
            {
                f"- {r['config']}: {', '.join(r['exchanges'])}"
                for r in layers
                if r["schedule"] == "comet"
            }
        ),
        "",
        "## (b) End to end, Lancet's GPT-2 MoE configurations",
        "",
        *_step_table(steps),
        "",
        "Decompositions chosen (lancet+comet, comet):",
        "",
        *sorted(
            {
                f"- {r['config']}, {r['schedule']}: partitions {r['partitions'] or 'none'}; "
                + (
                    ", ".join(x for x in r["exchanges"] if not x.endswith(" none"))
                    or "no exchange decomposed"
                )
                for r in steps
                if r["schedule"] in ("comet", "lancet+comet")
            }
        ),
        "",
    ]
    return simulated, ["## Targets", "", *_targets(layers, steps), ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "comet_eval.md")
    parser.add_argument("--step-gpus", default="16,32", help="(b): device counts, comma-separated")
    parser.add_argument("--step-models", help="(b): models of lancet_eval, ';'-separated")
    parser.add_argument(
        "--skip-simulator",
        action="store_true",
        help="keep (a), (b) and the targets from the results file it overwrites",
    )
    parser.add_argument(
        "--skip-cluster", action="store_true", help="keep (c) from the results file it overwrites"
    )
    parser.add_argument(
        "--cluster-from",
        type=Path,
        help="(c) predicted again from this saved run's measurements, without the cluster "
        f"(the committed run: {comet_cluster.MEASUREMENTS.relative_to(RESULTS.parent.parent)})",
    )
    args = parser.parse_args(argv)
    if args.cluster_from is not None and not args.cluster_from.is_dir():
        parser.error(f"--cluster-from {args.cluster_from}: no such directory")

    if args.skip_simulator:
        simulated = kept_section(args.out, "## (a)", "## (c)", "--skip-simulator")
        targets = kept_section(args.out, "## Targets", None, "--skip-simulator")
    else:
        simulated, targets = _simulated(args)
    if args.skip_cluster:
        cluster = kept_section(args.out, "## (c)", "## Targets", "--skip-cluster")
    else:
        cluster = [
            "## (c) Emulated cluster",
            "",
            *comet_cluster.section(
                saved=args.cluster_from,
                keep=None if args.cluster_from else comet_cluster.MEASUREMENTS,
                quick=args.quick,
            ),
        ]
    command = command_line("experiments.comet_eval", sys.argv[1:] if argv is None else argv)
    sections = [
        "# COMET evaluation",
        "",
        f"Command: `{command}`",
        "",
        "Instrument: the simulator (analytic cost model and two-stream timeline) for (a) and",
        "(b); the emulated cluster, measured, beside the simulator's prediction of it, for (c).",
        "`none` is the captured program in its own order, every collective",
        "synchronous; tutel-N pipelines each MoE layer's all-to-alls and experts in N chunks",
        "(`expert_pipeline`); `comet` decomposes each exchange, forward and backward, per",
        "source (rounds) or in chunks, chosen per MoE layer by the cost model. The speedup",
        "bound is none / max(compute, communication) of the captured program.",
        "",
        *simulated,
        *cluster,
        *targets,
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sections))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
