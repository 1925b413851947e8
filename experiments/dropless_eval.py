"""Dropless dispatch evaluated: capacity 1.25, padded dropless and ragged dropless on the
Mixtral-like and DeepSeek-like tiny presets, and expert placement for dropless routing.

    python -m experiments.dropless_eval [--steps 3] [--repeats 7] [--warm-steps 100]
        [--placement-steps 300]
        [--socket | --cluster-link-mbit MBIT [--allow-uncalibrated]] [--skip-dispatch]
        [--skip-placement]
    python -m experiments.dropless_eval --from experiments/results/dropless_eval.json

**Dispatch** (``--skip-dispatch`` leaves it out). On 8 fake CPU devices in this process
(``mixtral-tiny`` and ``deepseek_v3-tiny`` as their presets define them, layout 1 x 8, the
byte corpus), every variant of the MoE layers' dispatch (``VARIANTS``: capacity factor
1.25, padded dropless, ragged dropless with the worst-case receive buffer, ragged
dropless with a buffer of twice the rows of even routing), each from the same state,
trained ``--warm-steps`` steps first (``warmed_states``):

- bytes exchanged per device and step by the MoE layers (dispatch and return, forward and
  backward): what the step's ``all_to_all`` operands hold (read from the captured
  program; for the ragged variants the pieces of the static form that XLA:CPU runs, since
  it cannot run ``ragged_all_to_all``), and the rows ``ragged_all_to_all`` moves on GPU
  and TPU: every kept assignment's row once per exchange, counted from each step's
  routing (the capacity and padded buffers move whole on every backend);
- expert FLOPs per device and step (forward and backward): over the rows a grouped GEMM
  multiplies (the kept assignments; the padded buffers), over what XLA:CPU multiplies
  (JAX lowers ``ragged_dot`` there to a masked dense matmul per local slot: slots x
  receive buffer rows), and the compiled step's FLOPs from XLA's cost analysis;
- step time: ``--repeats`` rounds of ``--steps`` steps per variant after 2 untimed rounds,
  variants interleaved (the order reversed every other round), all on the same batches;
  the median of each round, then the median and range over rounds, and each round's
  ratio to capacity 1.25. Compiled memory: ``memory_analysis`` of the step;
- the dropped fraction, and the largest device's routed assignments over the mean.

**Sockets**. ``--cluster-link-mbit MBIT`` (root): the emulated cluster, 2 hosts x 4
devices joined by a link shaped to MBIT and calibrated first (``experiments.emulation``),
refused when the link fails calibration unless ``--allow-uncalibrated`` (the results say
so), each variant's step over the socket transport (schedule ``none``; the research
option ``--experimental.transport socket`` of ``experiments.emulation.experimental``) in
interleaved rounds: the bytes each host's devices sent to the other host
(``SocketTransport.traffic``, the pieces of a ragged exchange trimmed to their routed
rows), what those pieces were whole, and the step times. ``--socket``: the same on
loopback, without root (bytes; times without a slow link).

**Placement** (``--skip-placement`` leaves it out): static against dynamic expert
placement for dropless routing, and the planner replayed on their routing
(:mod:`experiments.dropless_placement`).

Writes ``experiments/results/dropless_eval.md`` and ``.json``; a run that leaves a part
out keeps that part's figures (and its command) from the JSON it overwrites. ``--from``
writes the results file from a saved JSON without running anything
(:mod:`experiments.dropless_report`). The variants and targets compared:
:mod:`experiments.dropless_variants`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.dropless_placement import PLACEMENT_PARTS, measure_placement
from experiments.dropless_report import write_report
from experiments.dropless_variants import (
    BASELINE,
    PRESETS,
    SOCKET_HOSTS,
    VARIANTS,
    WARM_VARIANT,
    WARMUP,
    variant_config,
)

MODULE = "experiments.dropless_eval"  # this program, also as the host program (--host)
RESULTS = Path(__file__).parent / "results"


def _is_ragged(config) -> bool:
    return config.moe.dropless and config.moe.dropless_dispatch == "ragged"


def _row_bytes(config) -> int:
    import jax.numpy as jnp

    return config.model.d_model * jnp.dtype(config.model.dtype).itemsize


def _tokens_per_device(config) -> int:
    return config.train.batch_size * config.model.seq_len // config.parallel.num_devices


# --- What each variant moves and computes ---------------------------------------------------


def program_exchanges(config, mesh) -> dict[str, float]:
    """From the captured step: bytes per device and step of its ``all_to_all`` operands
    (the MoE exchanges), of its ``all_gather`` operands (the ragged dispatch's counts), and
    the ragged variants' receive buffer rows (the grouped GEMM's left operand)."""
    import scheduling
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import capture_train_step

    program, _ = capture_train_step(resolve(config, mesh))

    def operand_bytes(primitive: str) -> float:
        ops = [op for op in program.ops if op.primitive == primitive]
        return float(sum(scheduling.aval_bytes(op.inputs[0].aval) for op in ops))

    grouped = [op for op in program.ops if op.primitive == "ragged_dot_general"]
    return {
        "a2a_bytes": operand_bytes("all_to_all"),
        "count_bytes": operand_bytes("all_gather"),
        "bound_rows": grouped[0].inputs[0].aval.shape[0] if grouped else None,
    }


def buffer_rows(config, bound_rows: int | None) -> dict[str, int | None]:
    """Rows of one MoE layer's expert buffers per device (forward): ``static``, the padded
    buffers that capacity and padded dropless multiply on every backend (None for ragged),
    and ``cpu``, what XLA:CPU multiplies (ragged: slots x receive buffer rows)."""
    moe, group = config.moe, config.parallel.expert
    local = moe.num_experts // group
    if _is_ragged(config):
        return {"static": None, "cpu": local * bound_rows}
    groups = _tokens_per_device(config) // config.group_size
    rows = local * group * groups * config.capacity_per_expert
    return {"static": rows, "cpu": rows}


def flops_per_row(config) -> float:
    """FLOPs of one row through one expert, forward and backward (3x the forward)."""
    hidden = config.moe.d_expert or config.model.d_ff
    matrices = 3 if config.model.activation == "swiglu" else 2
    return 3 * 2.0 * matrices * config.model.d_model * hidden


def kept_rows_per_device(config, metrics: dict) -> float:
    """Assignments kept per device in one step, over every MoE layer (measured)."""
    routed = float(np.sum(metrics["tokens_per_expert"]))
    return routed * (1.0 - float(metrics["dropped_fraction"])) / config.parallel.num_devices


def max_over_mean_load(metrics: dict, config) -> float:
    """The largest device's routed assignments over the mean, averaged over MoE layers
    (without replicas a device's load is its experts' routed assignments)."""
    per_expert = np.asarray(metrics["tokens_per_expert"], np.float64)  # [layers, experts]
    per_device = per_expert.reshape(per_expert.shape[0], config.parallel.expert, -1).sum(-1)
    return float(np.mean(per_device.max(axis=1) / per_device.mean(axis=1)))


def warmed_states(steps: dict, configs: dict, sampler, mesh, warm_steps: int) -> dict:
    """Every variant's train state: one initial state trained ``warm_steps`` steps by
    ``WARM_VARIANT``'s compiled step, copied for each variant (the steps donate theirs)."""
    import jax
    import jax.numpy as jnp

    from jaxmoe.data.batches import put_on_mesh
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.state import init_train_state

    state = init_train_state(resolve(configs[WARM_VARIANT], mesh))
    for index in range(warm_steps):
        # One step at a time, as the training loop runs them: several multi-device steps
        # in flight can starve XLA:CPU's collectives of threads.
        state, metrics = steps[WARM_VARIANT](state, put_on_mesh(sampler, index, mesh))
        jax.block_until_ready(metrics)
    return {variant: jax.tree.map(jnp.copy, state) for variant in configs}


def measure_variants(name: str, steps: int, repeats: int, warm_steps: int) -> dict[str, dict]:
    """Every variant of preset ``name`` in this process: compiled, started from the same
    state trained ``warm_steps`` steps (``warmed_states``), then timed in rounds."""
    import jax

    from experiments.emulation.host_process import round_order, train_batches
    from jaxmoe.data.batches import put_on_mesh
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import scheduled_train_step

    configs = {variant: variant_config(name, variant) for variant in VARIANTS}
    mesh = build_mesh(configs[BASELINE].parallel)
    results, compiled = {}, {}
    for variant, config in configs.items():
        planned = scheduled_train_step(resolve(config, mesh))
        started = time.perf_counter()
        step = planned.compile()
        compile_s = time.perf_counter() - started
        memory = step.memory_analysis()
        cost = step.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        results[variant] = {
            **program_exchanges(config, mesh),
            "compiled_flops": float(cost.get("flops", float("nan"))),
            "temp_bytes": int(memory.temp_size_in_bytes),
            "argument_bytes": int(memory.argument_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes),
            "compile_s": compile_s,
            "seconds": [],
        }
        compiled[variant] = step
        print(f"{name} {variant}: compiled in {compile_s:.0f} s", flush=True)
    sampler = train_batches(configs[BASELINE])
    states = warmed_states(compiled, configs, sampler, mesh, warm_steps)
    metrics: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for round_index in range(WARMUP + repeats):
        timed = round_index >= WARMUP
        for variant in round_order(list(VARIANTS), round_index):
            step, times = compiled[variant], []
            for index in range(steps if timed else 1):
                batch = put_on_mesh(sampler, warm_steps + round_index * steps + index, mesh)
                jax.block_until_ready(batch)
                started = time.perf_counter()
                states[variant], values = step(states[variant], batch)
                values = jax.device_get(values)  # waits for the step
                times.append(time.perf_counter() - started)
                if timed:
                    metrics[variant].append(values)
            if timed:
                results[variant]["seconds"].append(statistics.median(times))
    for variant, result in results.items():
        config, rows = configs[variant], metrics[variant]
        layers = len(config.model.moe_layers)
        kept = float(np.mean([kept_rows_per_device(config, row) for row in rows]))
        buffers = buffer_rows(config, result["bound_rows"])
        # Four exchanges per MoE layer: dispatch and return, forward and backward.
        moved = result["a2a_bytes"] if buffers["static"] else 4 * kept * _row_bytes(config)
        gemm_rows = kept if buffers["static"] is None else buffers["static"] * layers
        result.update(
            routed_bytes=moved,
            expert_flops_gemm=gemm_rows * flops_per_row(config),
            expert_flops_cpu=buffers["cpu"] * layers * flops_per_row(config),
            dropped_fraction=float(np.mean([row["dropped_fraction"] for row in rows])),
            max_over_mean_load=float(np.mean([max_over_mean_load(row, config) for row in rows])),
        )
    return results


# --- Over the socket transport: on loopback, or on the emulated cluster -------------------


def host_main(argv: list[str]) -> int:
    """The host program of the socket runs: every variant's step over the socket transport
    (schedule ``none``), in interleaved rounds on the same batches; per timed step, its
    seconds and the bytes this process's devices sent. Process 0 writes."""
    from experiments.emulation.experimental import Experimental
    from experiments.emulation.host_process import round_order, rounds_parser, start_host

    parser = rounds_parser("dropless_eval on hosts")
    parser.add_argument("--variants", type=Path, required=True, help="{variant: config}")
    parser.add_argument("--warm-steps", type=int, default=0, help="see warmed_states")
    argv, experimental = Experimental.split(argv)
    args = parser.parse_args(argv)
    prepared = start_host(args)

    import jax

    from experiments.emulation.host_process import train_batches
    from experiments.emulation.socket_transport import SocketTransport
    from jaxmoe.config import Config
    from jaxmoe.data.batches import put_on_mesh
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import scheduled_train_step

    mesh = prepared.mesh
    configs = {
        variant: Config.from_dict(values)
        for variant, values in json.loads(args.variants.read_text()).items()
    }
    steps = {
        variant: scheduled_train_step(resolve(config, mesh), experimental.options()).compile()
        for variant, config in configs.items()
    }
    sampler = train_batches(prepared.config)
    states = warmed_states(steps, configs, sampler, mesh, args.warm_steps)
    keys = ("remote", "remote_whole", "local", "local_whole")
    out = {variant: {"seconds": [], **{key: [] for key in keys}} for variant in configs}
    for round_index in range(args.warmup + args.rounds):
        batch = put_on_mesh(sampler, args.warm_steps + round_index, mesh)
        jax.block_until_ready(batch)
        for variant in round_order(list(configs), round_index):
            before = dict(SocketTransport.traffic)
            started = time.perf_counter()
            states[variant], metrics = steps[variant](states[variant], batch)
            jax.device_get(metrics)  # waits for the step
            seconds = time.perf_counter() - started
            after = dict(SocketTransport.traffic)
            if round_index < args.warmup:
                continue
            out[variant]["seconds"].append(seconds)
            for key in keys:
                out[variant][key].append(after.get(key, 0) - before.get(key, 0))
    if jax.process_index() == 0:
        report = {"devices_per_process": len(mesh.local_devices), "variants": out}
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def measure_sockets(
    repeats: int, warm_steps: int, link_mbit: float | None, allow_uncalibrated: bool = False
) -> tuple[dict[str, dict], dict | None]:
    """Every preset's variants over the socket transport (2 processes x 4 devices), on
    loopback or, with ``link_mbit``, on the emulated cluster: per preset, process 0's
    rounds; and the link's calibration (None on loopback)."""
    from experiments.emulation.experimental import Experimental
    from experiments.emulation.hosts import EmulatedHosts
    from jaxmoe.cli.launch import launch
    from jaxmoe.config import ScheduleConfig

    schedule = ScheduleConfig(name="none")
    sockets = Experimental(transport="socket", link_mbit=link_mbit or 0.0)
    with tempfile.TemporaryDirectory(prefix="jaxmoe-dropless-") as tmp:
        work = Path(tmp)

        def rounds(name: str, hosts: EmulatedHosts | None) -> dict:
            configs = {
                variant: dataclasses.replace(variant_config(name, variant), schedule=schedule)
                for variant in VARIANTS
            }
            variants, config = work / f"{name}-variants.json", work / f"{name}-config.json"
            variants.write_text(json.dumps({v: c.to_dict() for v, c in configs.items()}))
            config.write_text(json.dumps(configs[BASELINE].to_dict()))
            out = work / f"{name}-out.json"
            args = ["--host", "--config", str(config), "--json", str(out), "--variants"]
            args += [str(variants), "--rounds", str(repeats), "--warmup", str(WARMUP)]
            args += ["--warm-steps", str(warm_steps), *sockets.argv()]
            if hosts is None:
                if launch(args, SOCKET_HOSTS, module=MODULE):
                    raise RuntimeError(f"the socket rounds of {name} failed")
            else:
                hosts.run(name, args, module=MODULE)
            print(f"{name}: socket rounds done", flush=True)
            return json.loads(out.read_text())

        if link_mbit is None:
            return {name: rounds(name, None) for name in PRESETS}, None
        from experiments.emulation.link_calibration import calibrated_network
        from experiments.emulation.network import LinkShape

        with calibrated_network(
            SOCKET_HOSTS, LinkShape(rate_mbit=link_mbit), allow_uncalibrated=allow_uncalibrated
        ) as (network, calibration):
            hosts = EmulatedHosts(network, work, f"{link_mbit:g}mbit")
            return {name: rounds(name, hosts) for name in PRESETS}, calibration.to_dict()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--host"]:
        return host_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds")
    parser.add_argument(
        "--warm-steps", type=int, default=100, help="training steps before the measured ones"
    )
    parser.add_argument("--placement-steps", type=int, default=300)
    parser.add_argument(
        "--placement-parts",
        default=",".join(PLACEMENT_PARTS),
        help="which placement runs (comma-separated; the others keep their figures)",
    )
    sockets = parser.add_mutually_exclusive_group()
    sockets.add_argument("--socket", action="store_true", help="socket runs on loopback")
    sockets.add_argument("--cluster-link-mbit", type=float, help="socket runs on the cluster")
    parser.add_argument(
        "--allow-uncalibrated", action="store_true", help="a link that fails calibration too"
    )
    parser.add_argument("--skip-dispatch", action="store_true")
    parser.add_argument("--skip-placement", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "dropless_eval.md")
    parser.add_argument("--from", dest="source", type=Path, help="only write the results file")
    args = parser.parse_args(argv)
    if args.source is not None:
        print(write_report(json.loads(args.source.read_text()), args.out))
        return 0

    from experiments.shared.results_file import command_line
    from jaxmoe.parallel.host_devices import ensure_host_devices

    ensure_host_devices(8)
    command = command_line(MODULE, argv)
    previous = args.out.with_suffix(".json")
    # The parts not measured this time are kept, with their command.
    result: dict = json.loads(previous.read_text()) if previous.exists() else {}
    result["host"] = f"{platform.machine()}, {os.cpu_count()} CPU cores, Python " + (
        platform.python_version()
    )
    result.setdefault("commands", {})
    if not args.skip_dispatch:
        result["dispatch"] = {
            name: measure_variants(name, args.steps, args.repeats, args.warm_steps)
            for name in PRESETS
        }
        result["presets"] = {
            name: dataclasses.asdict(variant_config(name, BASELINE).moe) for name in PRESETS
        }
        result.update(steps=args.steps, repeats=args.repeats, warm_steps=args.warm_steps)
        result["commands"]["dispatch"] = command
    if args.socket or args.cluster_link_mbit:
        from experiments.emulation.link_calibration import LinkNotCalibrated

        try:
            measured, calibration = measure_sockets(
                args.repeats, args.warm_steps, args.cluster_link_mbit, args.allow_uncalibrated
            )
        except LinkNotCalibrated as error:  # the calibration went to standard error
            print(f"{MODULE}: the link failed calibration: {error}", file=sys.stderr)
            return 3
        result["sockets"] = {
            "measured": measured,
            "calibration": calibration,
            "link_mbit": args.cluster_link_mbit,
            "rounds": args.repeats,
            "warm_steps": args.warm_steps,
        }
        result["commands"]["sockets"] = command
    if not args.skip_placement:
        parts = args.placement_parts.split(",")
        unknown = sorted(set(parts) - set(PLACEMENT_PARTS))
        if unknown:
            parser.error(f"--placement-parts: {unknown}: choose from {list(PLACEMENT_PARTS)}")
        if result.get("placement_steps") not in (None, args.placement_steps):
            result.pop("placement", None)  # parts of another length are not comparable
        result.setdefault("placement", {}).update(measure_placement(args.placement_steps, parts))
        result["placement_steps"] = args.placement_steps
        for part in parts:
            result["commands"][f"placement {part}"] = command
    print(write_report(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
