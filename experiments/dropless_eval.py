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
so), each variant's step over the socket transport (schedule ``none``) in interleaved rounds:
the bytes each host's devices sent to the other host (``SocketTransport.traffic``, the
pieces of a ragged exchange trimmed to their routed rows), what those pieces were whole,
and the step times. ``--socket``: the same on loopback, without root (bytes; times
without a slow link).

**Placement** (``--skip-placement`` leaves it out). ``tiny`` (8 experts, top-1, 8
devices, 2 expert slots per device: each device's own expert and one replica slot),
``--placement-steps`` steps of training each, static placement (every expert two
copies) against dynamic (re-planned after every step): in dropless mode (ragged) the
largest device load over the mean (``device_load``: the rows each device's slots took),
in capacity mode (1.25) the dropped fraction. Then the planner replayed on the static
runs' routing, with the routing predicted by its smoothed history, by the last step
alone, by the smoothed mean alone, and with hindsight (each step planned from its own
routing); a sweep of the history's constants (``SMOOTHING_GRID``); and how far the
routed loads persist from step to step. In dropless mode the placement changes only the
rounding of the step (the runs' routing drifts apart slowly), so the replays are what
those tables would have done; in capacity mode drops change training, so they replay the
static run's routing. The ratios' spread: the same ratio in each of ``PLACEMENT_BLOCKS``
blocks of the last half's steps. These runs deal an expert's rows round-robin over its
copies; a third pair (``dropless_balanced``) splits them in the step from its own counts
(``moe.replica_split balanced``), replayed with the planner's prediction and with
hindsight. ``--placement-parts`` picks the pairs run (``PLACEMENT_PARTS``).

Writes ``experiments/results/dropless_eval.md`` and ``.json``; a run that leaves a part
out keeps that part's figures (and its command) from the JSON it overwrites. ``--from``
writes the results file from a saved JSON without running anything.
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

MODULE = "experiments.dropless_eval"  # this program, also as the host program (--host)
RESULTS = Path(__file__).parent / "results"
PRESETS = ("mixtral-tiny", "deepseek_v3-tiny")
BASELINE = "capacity 1.25"
VARIANTS = {
    BASELINE: {"capacity_factor": 1.25},
    "padded dropless": {"capacity_factor": None, "dropless_dispatch": "padded"},
    "ragged dropless": {"capacity_factor": None, "dropless_dispatch": "ragged"},
    "ragged dropless, 2x buffer": {
        "capacity_factor": None,
        "dropless_dispatch": "ragged",
        "ragged_buffer_factor": 2.0,
    },
}
WARMUP = 2  # untimed rounds first
# Every variant starts from the same state, trained this many steps by the padded dropless
# step first (exact dropless routing): routing straight after initialisation is far more
# skewed than in training, and drops and loads are measured on the routing of a model
# that has begun to balance it.
WARM_VARIANT = "padded dropless"
SOCKET_HOSTS = 2
BYTES_TARGET = 1.1  # ragged dropless moves at most this times the bytes of capacity 1.25
PLACEMENT_TARGET = 0.5  # dynamic placement: at most this times static's excess load, drops
PLACEMENT_SLOTS = 2  # expert slots per device in the placement runs
# The routing history's constants swept by the replays: (half-life in steps, last step's
# weight), as jaxmoe.train.routing_history.SMOOTHING gives them.
SMOOTHING_HALF_LIVES = (8.0, 32.0, 128.0)
SMOOTHING_LATEST = (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)
SMOOTHING_GRID = tuple((h, w) for h in SMOOTHING_HALF_LIVES for w in SMOOTHING_LATEST)
PLACEMENT_BLOCKS = 5  # the last half's steps in this many blocks, for the ratios' spread
PERSISTENCE_LAGS = (1, 5, 20)
REPLAYS = ("static", "smoothed", "last", "mean", "fitted", "hindsight")


def variant_config(name: str, variant: str, steps: int = 100):
    from jaxmoe.presets import preset

    base = preset(name)
    moe = dataclasses.replace(base.moe, **VARIANTS[variant])
    train = dataclasses.replace(base.train, steps=steps, checkpoint_every=0, eval_every=steps)
    return dataclasses.replace(base, moe=moe, train=train)


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
    from jaxmoe.train.scheduled import capture_train_step

    program, _ = capture_train_step(config, mesh)

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

    from jaxmoe.train.data import put_on_mesh
    from jaxmoe.train.state import init_train_state

    state = init_train_state(configs[WARM_VARIANT], mesh)
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
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.data import put_on_mesh
    from jaxmoe.train.scheduled import plan_train_step

    configs = {variant: variant_config(name, variant) for variant in VARIANTS}
    mesh = build_mesh(configs[BASELINE].parallel)
    results, compiled = {}, {}
    for variant, config in configs.items():
        planned = plan_train_step(config, mesh)
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
    from experiments.emulation.host_process import round_order, rounds_parser, start_host

    parser = rounds_parser("dropless_eval on hosts")
    parser.add_argument("--variants", type=Path, required=True, help="{variant: config}")
    parser.add_argument("--warm-steps", type=int, default=0, help="see warmed_states")
    args = parser.parse_args(argv)
    prepared = start_host(args)

    import jax

    import scheduling
    from experiments.emulation.host_process import train_batches
    from jaxmoe.config import Config
    from jaxmoe.train.data import put_on_mesh
    from jaxmoe.train.scheduled import plan_train_step

    mesh = prepared.mesh
    configs = {
        variant: Config.from_dict(values)
        for variant, values in json.loads(args.variants.read_text()).items()
    }
    steps = {
        variant: plan_train_step(config, mesh).compile() for variant, config in configs.items()
    }
    sampler = train_batches(prepared.config)
    states = warmed_states(steps, configs, sampler, mesh, args.warm_steps)
    keys = ("remote", "remote_whole", "local", "local_whole")
    out = {variant: {"seconds": [], **{key: [] for key in keys}} for variant in configs}
    for round_index in range(args.warmup + args.rounds):
        batch = put_on_mesh(sampler, args.warm_steps + round_index, mesh)
        jax.block_until_ready(batch)
        for variant in round_order(list(configs), round_index):
            before = dict(scheduling.SocketTransport.traffic)
            started = time.perf_counter()
            states[variant], metrics = steps[variant](states[variant], batch)
            jax.device_get(metrics)  # waits for the step
            seconds = time.perf_counter() - started
            after = dict(scheduling.SocketTransport.traffic)
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
    from experiments.emulation.hosts import EmulatedHosts
    from jaxmoe.cli.launch import launch
    from jaxmoe.config import ScheduleConfig

    schedule = dataclasses.replace(
        ScheduleConfig(), name="none", transport="socket", link_mbit=link_mbit or 0.0
    )
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
            args += ["--warm-steps", str(warm_steps)]
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


# --- Placement ------------------------------------------------------------------------------


def placement_config(steps: int, rebalance: int, dropless: bool, split: str = "round_robin"):
    base = variant_config("tiny", "ragged dropless" if dropless else BASELINE, steps)
    moe = dataclasses.replace(
        base.moe,
        slots_per_device=PLACEMENT_SLOTS,
        rebalance_every=rebalance,
        # How the ragged dispatch splits an expert's rows: capacity mode has no such choice.
        replica_split=split if dropless else base.moe.replica_split,
    )
    return dataclasses.replace(base, moe=moe, train=dataclasses.replace(base.train, eval_batches=4))


def excess_load(loads: np.ndarray) -> float:
    """``loads [layers, devices]``: (largest over mean) - 1, averaged over the layers."""
    loads = np.asarray(loads, np.float64)
    return float(np.mean(loads.max(axis=1) / loads.mean(axis=1) - 1))


def _history(mode: str, smoothing: tuple[float, float] | None = None):
    """The planner's routing history for a replay ``mode``: ``smoothed`` (its own
    constants, or ``smoothing`` for both metrics), ``last`` (the last step alone),
    ``mean`` (the smoothed mean alone) or ``hindsight`` (a fresh one every step)."""
    from jaxmoe.train.routing_history import SMOOTHING, RoutingHistory

    if mode == "smoothed" and smoothing is not None:
        return RoutingHistory({key: smoothing for key in SMOOTHING})
    if mode == "last":
        return RoutingHistory({key: (1.0, 1.0) for key in SMOOTHING})
    if mode == "mean":
        return RoutingHistory({key: (half_life, 0.0) for key, (half_life, _) in SMOOTHING.items()})
    return RoutingHistory()


def fitted_loads(rows: list[dict], start: int) -> np.ndarray:
    """``[steps - start, layers, experts]``: from step ``start`` on, each layer's routed
    loads as the least-squares affine function of the step before (every expert's load),
    fitted on those very steps: what the best one-step linear predictor could do, the fit
    made with hindsight."""
    load = np.asarray([row["tokens_per_expert"] for row in rows], np.float64)
    previous = load[start - 1 : -1]
    fitted = np.empty_like(load[start:])
    for layer in range(load.shape[1]):
        x = np.concatenate([previous[:, layer], np.ones((len(previous), 1))], axis=1)
        coefficients, *_ = np.linalg.lstsq(x, load[start:, layer], rcond=None)
        fitted[:, layer] = np.maximum(x @ coefficients, 0.0)
    return fitted


def replay(
    rows: list[dict], config, mode: str, smoothing: tuple[float, float] | None = None
) -> list[float]:
    """The planner's tables (re-planned after every step) applied to the routing of
    ``rows``, per step: dropless, the device load's (max / mean) - 1; capacity, the dropped
    fraction (exact from ``kept_by_copies``). ``mode``, ``smoothing``: see ``_history``;
    mode ``static``: the initial table throughout; ``fitted`` (dropless): planned from
    ``fitted_loads`` over the last half (before it, from the last step)."""
    from jaxmoe.parallel.placement import replicas_per_expert
    from jaxmoe.train.placement_planner import device_loads, plan_placement
    from jaxmoe.train.state import initial_placement

    history = _history("last" if mode == "fitted" else mode, smoothing)
    half = len(rows) // 2
    fitted = fitted_loads(rows, half) if mode == "fitted" else None
    table = np.asarray(initial_placement(config))
    values = []
    for index, row in enumerate(rows):
        if mode == "static":
            pass
        elif mode == "hindsight":
            table, _ = plan_placement(table, [row], config, row["step"], _history(mode))
        elif fitted is not None and index >= half:
            predicted = {"step": row["step"], "tokens_per_expert": fitted[index - half]}
            table, _ = plan_placement(table, [predicted], config, row["step"], _history(mode))
        elif index:
            table, _ = plan_placement(table, [rows[index - 1]], config, row["step"], history)
        load = np.asarray(row["tokens_per_expert"], np.float64)  # [layers, experts]
        if config.moe.dropless:
            split = config.moe.replica_split
            per_layer = [
                device_loads(table[layer], load[layer], split) for layer in range(len(load))
            ]
            values.append(excess_load(per_layer))
            continue
        kept = np.asarray(row["kept_by_copies"])  # [layers, experts, copies]
        copies = np.minimum(replicas_per_expert(table, config.moe.num_experts), kept.shape[2])
        total = np.take_along_axis(kept, copies[..., None] - 1, axis=2).sum()
        values.append(float(1 - total / load.sum()))
    return values


def persistence(rows: list[dict]) -> dict[str, float]:
    """How far each expert's share of the routed assignments persists: the correlation,
    over experts, layers and steps, of its deviation from its mean over ``rows`` with the
    deviation ``lag`` steps later, for each lag of ``PERSISTENCE_LAGS``."""
    load = np.asarray([row["tokens_per_expert"] for row in rows], np.float64)
    share = load / load.sum(axis=-1, keepdims=True)  # [steps, layers, experts]
    deviation = share - share.mean(axis=0)
    return {
        str(lag): float(np.corrcoef(deviation[:-lag].ravel(), deviation[lag:].ravel())[0, 1])
        for lag in PERSISTENCE_LAGS
    }


def _placement_series(rows: list[dict], dropless: bool) -> np.ndarray:
    """Per step: dropless, the device load's max/mean - 1; capacity, the dropped fraction."""
    if dropless:
        return np.array([excess_load(row["device_load"]) for row in rows])
    return np.array([row["dropped_fraction"] for row in rows])


def block_ratios(numerator: np.ndarray, denominator: np.ndarray) -> list[float]:
    """The ratio of the two series' means in each of ``PLACEMENT_BLOCKS`` blocks."""
    return [
        float(np.mean(n) / np.mean(d))
        for n, d in zip(
            np.array_split(numerator, PLACEMENT_BLOCKS),
            np.array_split(denominator, PLACEMENT_BLOCKS),
            strict=True,
        )
    ]


def measure_placement_mode(steps: int, dropless: bool, split: str = "round_robin") -> dict:
    """Static and dynamic runs of one mode, and the replays on the static run's routing
    (figures over the last half of the steps, and over the whole run). Under the balanced
    split only the planner's own prediction and hindsight are replayed."""
    from experiments.placement_eval import _run

    runs, applied = {}, 0
    for label, rebalance in (("static", 0), ("dynamic", 1)):
        rows, decisions, seconds = _run(placement_config(steps, rebalance, dropless, split))
        runs[label] = rows
        applied += sum(bool(decision.get("applied")) for decision in decisions)
        print(f"placement, dropless {dropless}, {split}, {label}: {seconds:.0f} s", flush=True)
    static, dynamic = runs["static"], runs["dynamic"]
    config, half = placement_config(steps, 1, dropless, split), steps // 2
    measured = {label: _placement_series(rows, dropless) for label, rows in runs.items()}
    if split == "balanced":
        modes = ["static", "smoothed", "hindsight"]
    else:
        modes = [mode for mode in REPLAYS if dropless or mode != "fitted"]
    replays = {mode: np.array(replay(static, config, mode)) for mode in modes}
    entry = {
        "static": float(np.mean(measured["static"][half:])),
        "dynamic": float(np.mean(measured["dynamic"][half:])),
        "static_whole": float(np.mean(measured["static"])),
        "dynamic_whole": float(np.mean(measured["dynamic"])),
        "blocks": block_ratios(measured["dynamic"][half:], measured["static"][half:]),
        "changes_applied": applied,
        "largest_dropped": max(row["dropped_fraction"] for row in static + dynamic),
        "loss_static": float(np.mean([row["loss"] for row in static[-20:]])),
        "loss_dynamic": float(np.mean([row["loss"] for row in dynamic[-20:]])),
        "replay": {mode: float(np.mean(values[half:])) for mode, values in replays.items()},
        "replay_blocks": block_ratios(replays["smoothed"][half:], replays["static"][half:]),
    }
    if split == "balanced":
        return entry
    return {
        **entry,
        "sweep": [
            [h, w, float(np.mean(replay(static, config, "smoothed", (h, w))[half:]))]
            for h, w in SMOOTHING_GRID
        ],
        "persistence": persistence(static[half:]),
    }


# The placement runs: (dropless, how the ragged dispatch splits an expert's rows).
PLACEMENT_PARTS = {
    "dropless": (True, "round_robin"),
    "capacity": (False, "round_robin"),
    "dropless_balanced": (True, "balanced"),
}


def measure_placement(steps: int, parts: list[str]) -> dict:
    return {part: measure_placement_mode(steps, *PLACEMENT_PARTS[part]) for part in parts}


# --- The results file -----------------------------------------------------------------------


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def _kib_counts(dispatch: dict) -> str:
    counts = [dispatch[name]["ragged dropless"]["count_bytes"] for name in dispatch]
    return " and ".join(f"{value / 2**10:.2f} KiB" for value in counts)


def _ratios(values: list[float], baseline: list[float]):
    from experiments.shared.spread import Spread, round_ratios

    return Spread.of(round_ratios(values, baseline))


def _dispatch_tables(name: str, results: dict) -> list[str]:
    from experiments.shared.spread import Spread

    base = results[BASELINE]
    lines = [
        f"### `{name}`",
        "",
        "| variant | all-to-all operands (MiB) | moved by `ragged_all_to_all` (MiB) "
        "| / capacity 1.25 | expert GFLOPs: grouped GEMM | expert GFLOPs: XLA:CPU "
        "| compiled step GFLOPs | dropped | max/mean device load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        lines.append(
            f"| {variant} | {_mib(r['a2a_bytes'])} | {_mib(r['routed_bytes'])} | "
            f"{r['routed_bytes'] / base['routed_bytes']:.3f} | "
            f"{r['expert_flops_gemm'] / 1e9:.3f} | {r['expert_flops_cpu'] / 1e9:.3f} | "
            f"{r['compiled_flops'] / 1e9:.2f} | {r['dropped_fraction']:.4f} | "
            f"{r['max_over_mean_load']:.3f} |"
        )
    lines += [
        "",
        "| variant | step (ms), median [range] | / capacity 1.25, per round "
        "| temp (MiB) | arguments + outputs (MiB) | receive buffer rows |",
        "|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        lines.append(
            f"| {variant} | {Spread.of(r['seconds']).format()} | "
            f"{_ratios(r['seconds'], base['seconds']).format(1, 3)} | {_mib(r['temp_bytes'])} | "
            f"{_mib(r['argument_bytes'] + r['output_bytes'])} | {r['bound_rows'] or '-'} |"
        )
    return [*lines, ""]


def _socket_figures(measured: dict) -> dict[str, dict]:
    """Per variant: mean bytes per device and step sent to the other host (trimmed and
    whole) and the step seconds of each round."""
    devices = measured["devices_per_process"]
    return {
        variant: {
            "remote": float(np.mean(v["remote"])) / devices,
            "remote_whole": float(np.mean(v["remote_whole"])) / devices,
            "seconds": v["seconds"],
        }
        for variant, v in measured["variants"].items()
    }


def _socket_table(name: str, measured: dict, shaped: bool) -> list[str]:
    from experiments.shared.spread import Spread

    figures = _socket_figures(measured)
    base = figures[BASELINE]
    where = "shaped link" if shaped else "loopback"
    lines = [
        f"### `{name}`",
        "",
        "| variant | sent to the other host (MiB) | / capacity 1.25 | the same pieces whole "
        f"(MiB) | step on the {where} (ms), median [range] | / capacity 1.25, per round |",
        "|---|---|---|---|---|---|",
    ]
    for variant, f in figures.items():
        lines.append(
            f"| {variant} | {_mib(f['remote'])} | {f['remote'] / base['remote']:.3f} | "
            f"{_mib(f['remote_whole'])} | {Spread.of(f['seconds']).format()} | "
            f"{_ratios(f['seconds'], base['seconds']).format(1, 3)} |"
        )
    return [*lines, ""]


def _inside(spread) -> str:
    return "inside the spread" if spread.low <= 1.0 <= spread.high else "outside the spread"


def _met(value: float, target: float) -> str:
    return "met" if value <= target else "missed"


def _preset_reading(name: str, results: dict, moe: dict) -> str:
    """What one preset's dispatch figures say, each statement read off them."""
    base, ragged = results[BASELINE], results["ragged dropless"]
    padded, bounded = results["padded dropless"], results["ragged dropless, 2x buffer"]
    ratio = ragged["routed_bytes"] / base["routed_bytes"]
    time_ragged = _ratios(ragged["seconds"], padded["seconds"])
    time_bounded = _ratios(bounded["seconds"], padded["seconds"])
    cpu_ragged = ragged["expert_flops_cpu"] / padded["expert_flops_cpu"]
    cpu_bounded = bounded["expert_flops_cpu"] / padded["expert_flops_cpu"]
    return (
        f"`{name}` ({moe['num_experts']} experts, top-{moe['top_k']}): ragged dropless "
        f"moves {ratio:.3f}x the bytes of capacity 1.25 where `ragged_all_to_all` runs "
        f"(target <= {BYTES_TARGET}: {_met(ratio, BYTES_TARGET)}), padded dropless "
        f"{padded['routed_bytes'] / base['routed_bytes']:.2f}x (E/k = "
        f"{moe['num_experts'] / moe['top_k']:g}); nothing dropped "
        f"({ragged['dropped_fraction']:.4f}). On XLA:CPU the static form's all-to-all "
        f"operands are {ragged['a2a_bytes'] / padded['a2a_bytes']:.2f}x the padded ones, and "
        f"its grouped GEMM multiplies {cpu_ragged:.2f}x the padded rows (the worst-case "
        "buffer, masked per slot) where a grouped GEMM multiplies "
        f"{ragged['expert_flops_gemm'] / padded['expert_flops_gemm']:.3f}x; its step takes "
        f"{time_ragged.format(1, 3)}x the padded step ({_inside(time_ragged)}) and its "
        f"temporaries {ragged['temp_bytes'] / padded['temp_bytes']:.2f}x. With the 2x buffer: "
        f"{cpu_bounded:.2f}x the padded rows on CPU, step {time_bounded.format(1, 3)}x "
        f"({_inside(time_bounded)}), temporaries "
        f"{bounded['temp_bytes'] / padded['temp_bytes']:.2f}x, and "
        f"{bounded['dropped_fraction']:.4f} of the assignments dropped past the buffer."
    )


def _socket_reading(name: str, measured: dict) -> str:
    figures = _socket_figures(measured)
    ragged, padded = figures["ragged dropless"], figures["padded dropless"]
    ratio = ragged["remote"] / figures[BASELINE]["remote"]
    time_padded = _ratios(ragged["seconds"], padded["seconds"])
    time_base = _ratios(ragged["seconds"], figures[BASELINE]["seconds"])
    return (
        f"Sockets, `{name}`: ragged dropless sent {ratio:.3f}x the bytes of capacity 1.25 to "
        f"the other host (target <= {BYTES_TARGET}: {_met(ratio, BYTES_TARGET)}), its pieces "
        f"{ragged['remote'] / ragged['remote_whole']:.3f}x their whole size; its step took "
        f"{time_padded.format(1, 3)}x the padded step ({_inside(time_padded)}) and "
        f"{time_base.format(1, 3)}x the capacity 1.25 step ({_inside(time_base)}), per round."
    )


def _dispatch_reading(result: dict) -> list[str]:
    lines = []
    for name in PRESETS:
        if name in result["dispatch"]:
            text = _preset_reading(name, result["dispatch"][name], result["presets"][name])
            lines += [text, ""]
    for name in PRESETS:
        if name in result.get("sockets", {}).get("measured", {}):
            lines += [_socket_reading(name, result["sockets"]["measured"][name]), ""]
    return lines


def _range(values: list[float]) -> str:
    return f"[{min(values):.3f}-{max(values):.3f}]"


def _replayed(entry: dict) -> float:
    return entry["replay"]["smoothed"] / entry["replay"]["static"]


def _placement_lines(result: dict) -> list[str]:
    from jaxmoe.train.routing_history import SMOOTHING

    p, steps = result["placement"], result["placement_steps"]
    d, c = p["dropless"], p["capacity"]
    half = steps // 2

    def ratio(entry: dict, key: str = "") -> float:
        return entry[f"dynamic{key}"] / entry[f"static{key}"]

    lines = [
        f"## Placement: `tiny`, {steps} steps, {PLACEMENT_SLOTS} slots per device, static "
        "against dynamic (re-planned after every step)",
        "",
        "8 experts, top-1, 8 devices: each device's own expert and one replica slot. Static: "
        "every expert two copies. Figures over the last half of the run (steps "
        f"{half}-{steps - 1}) unless they say otherwise; a ratio's range is its value in "
        f"each of {PLACEMENT_BLOCKS} blocks of those steps.",
        "",
        "| | static | dynamic | dynamic / static [range over blocks] |",
        "|---|---|---|---|",
        f"| dropless (ragged): device load max/mean - 1 | {d['static']:.4f} | "
        f"{d['dynamic']:.4f} | **{ratio(d):.3f}** {_range(d['blocks'])} |",
        f"| the same, whole run | {d['static_whole']:.4f} | {d['dynamic_whole']:.4f} | "
        f"{ratio(d, '_whole'):.3f} |",
        f"| dropless: largest dropped fraction of any step | {d['largest_dropped']:.4f} | | |",
        f"| dropless: loss, mean of the last 20 steps | {d['loss_static']:.4f} | "
        f"{d['loss_dynamic']:.4f} | |",
        f"| capacity 1.25: dropped fraction | {c['static']:.4f} | {c['dynamic']:.4f} | "
        f"**{ratio(c):.3f}** {_range(c['blocks'])} |",
        f"| the same, whole run | {c['static_whole']:.4f} | {c['dynamic_whole']:.4f} | "
        f"{ratio(c, '_whole'):.3f} |",
        f"| capacity 1.25: loss, mean of the last 20 steps | {c['loss_static']:.4f} | "
        f"{c['loss_dynamic']:.4f} | |",
        "",
        f"Targets (dynamic at most {PLACEMENT_TARGET}x static): dropless excess load "
        f"{ratio(d):.3f}x, {_met(ratio(d), PLACEMENT_TARGET)}; capacity-mode drops "
        f"{ratio(c):.3f}x, {_met(ratio(c), PLACEMENT_TARGET)}. On the same routing (the "
        f"replays below): {_replayed(d):.3f}x {_range(d['replay_blocks'])}, "
        f"{_met(_replayed(d), PLACEMENT_TARGET)}, and {_replayed(c):.3f}x "
        f"{_range(c['replay_blocks'])}, {_met(_replayed(c), PLACEMENT_TARGET)}.",
        "",
        "The planner replayed on the static runs' routing (re-planned after every step; "
        "last half; in parentheses, over the replayed static placement), the routing it "
        "plans from predicted in several ways. *Static, replayed*: the static table on "
        "that routing, which checks the replay against the run (dropless: each expert's "
        "rows split evenly over its copies; capacity: `kept_by_copies`, exact). *Linear, "
        "fitted with hindsight*: each layer's loads as the least-squares affine function of "
        "the step before, fitted on the very steps it predicts (an upper bound on any "
        "one-step linear predictor; dropless only):",
        "",
        "| | static, replayed | smoothed history (the planner: "
        f"{SMOOTHING['tokens_per_expert']}) | last step alone | smoothed mean alone "
        "| linear, fitted with hindsight | hindsight (each step's own routing) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, entry in (("dropless: device load max/mean - 1", d), ("capacity: dropped", c)):
        r = entry["replay"]
        cells = [
            f"{r[mode]:.4f} ({r[mode] / r['static']:.3f}x)" if mode in r else "-"
            for mode in REPLAYS[1:]
        ]
        lines.append(f"| {label} | {r['static']:.4f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The history's constants swept, replayed as above (rows: the half-life in steps; "
        "columns: the last step's weight; the smallest in bold):",
        "",
        "| | half-life | " + " | ".join(f"{w:g}" for w in SMOOTHING_LATEST) + " |",
        "|---|---|" + "---|" * len(SMOOTHING_LATEST),
    ]
    for label, entry in (("dropless: max/mean - 1", d), ("capacity: dropped", c)):
        values = {(h, w): value for h, w, value in entry["sweep"]}
        best = min(values.values())
        for h in SMOOTHING_HALF_LIVES:
            cells = [
                f"**{values[h, w]:.4f}**" if values[h, w] == best else f"{values[h, w]:.4f}"
                for w in SMOOTHING_LATEST
            ]
            lines.append(f"| {label} | {h:g} | " + " | ".join(cells) + " |")
    lags = list(d["persistence"])
    lines += [
        "",
        "Persistence of the routed loads (static runs, last half): the correlation of each "
        "expert's share's deviation from its mean with the same deviation later:",
        "",
        "| | " + " | ".join(f"{lag} step{'s' if lag != '1' else ''} later" for lag in lags) + " |",
        "|---|" + "---|" * len(lags),
    ]
    for label, entry in (("dropless", d), ("capacity 1.25", c)):
        values = " | ".join(f"{entry['persistence'][lag]:.3f}" for lag in lags)
        lines.append(f"| {label} | {values} |")
    lines += ["", *_placement_reading(d, c)]
    if "dropless_balanced" in p:
        lines += ["", *_balanced_split_lines(d, p["dropless_balanced"])]
    return lines


def _balanced_split_lines(d: dict, b: dict) -> list[str]:
    """The runs whose step splits each expert's rows over its copies from its own counts,
    beside the round-robin runs ``d``."""
    rr, rb = d["static"], b["replay"]
    rows = [
        ("static table, rows dealt round-robin (above)", rr, ""),
        ("dynamic table, rows dealt round-robin (above)", d["dynamic"], _range(d["blocks"])),
        ("static table, balanced split", b["static"], ""),
        ("dynamic table, balanced split", b["dynamic"], ""),
    ]
    lines = [
        "### The step's own split (`moe.replica_split balanced`)",
        "",
        "The same dropless runs with the ragged dispatch splitting each expert's rows over "
        "its copies inside the step, from that step's routed counts "
        "(`jaxmoe/layers/copy_split.py`); the planner judges its tables under that split "
        "over the last steps' routing. Last half of each run; the range over blocks is "
        "that of dynamic over static within a pair of runs.",
        "",
        "| dropless: device load max/mean - 1 | value | / static, round-robin |",
        "|---|---|---|",
        *(
            f"| {label} | {value:.4f} | {value / rr:.3f} {spread} |"
            for label, value, spread in rows
        ),
        f"| dynamic over static, both balanced | | {b['dynamic'] / b['static']:.3f} "
        f"{_range(b['blocks'])} |",
        f"| the same, whole run: static, dynamic | {b['static_whole']:.4f}, "
        f"{b['dynamic_whole']:.4f} | {b['static_whole'] / d['static_whole']:.3f}, "
        f"{b['dynamic_whole'] / d['static_whole']:.3f} |",
        f"| largest dropped fraction of any step | {b['largest_dropped']:.4f} | |",
        f"| loss, mean of the last 20 steps: static, dynamic | {b['loss_static']:.4f}, "
        f"{b['loss_dynamic']:.4f} | |",
        "",
        "Replayed on the balanced static run's routing (as above; the planner's tables "
        "under the balanced split): static table "
        f"{rb['static']:.4f}, the planner's {rb['smoothed']:.4f} "
        f"({rb['smoothed'] / rb['static']:.3f}x), planned from each step's own routing "
        f"{rb['hindsight']:.4f} ({rb['hindsight'] / rb['static']:.3f}x).",
        "",
        f"Target (the static excess load at most {PLACEMENT_TARGET}x): placement with the "
        f"step's own split leaves {b['dynamic'] / rr:.3f}x the excess load of static "
        f"placement dealt round-robin, {_met(b['dynamic'] / rr, PLACEMENT_TARGET)}; the "
        f"static table alone under the split {b['static'] / rr:.3f}x. Between tables, under "
        f"the split, dynamic over static is {b['dynamic'] / b['static']:.3f}x "
        f"{_range(b['blocks'])}.",
        "",
        "Reading. The split is the choice made within the step that the replays above point "
        "to: it follows each step's own routing, which no table made before the step can. "
        "On the static table (every expert two copies, each device sharing with the next) "
        f"it leaves {b['static']:.4f} of excess load over the last half; what remains is "
        "steps whose hot experts hold more rows than the devices of their copies can take "
        f"at the mean (the whole run's {b['static_whole']:.4f} is mostly the first steps, "
        "whose routing is far more skewed). The planner, judging tables under the split "
        "over the last steps' routing, keeps the spread table on this routing (replayed: "
        f"{rb['smoothed'] / rb['static']:.3f}x); a table chosen from each step's own "
        f"routing would reach {rb['hindsight'] / rb['static']:.3f}x of it, the part of "
        "the routing that the steps before do not predict.",
    ]
    return lines


def _placement_reading(d: dict, c: dict) -> list[str]:
    """Why the placement figures are what they are, each statement read off them."""
    from jaxmoe.train.routing_history import SMOOTHING

    rd, rc = d["replay"], c["replay"]
    hindsight_d = rd["hindsight"] / rd["static"]
    hindsight_c = rc["hindsight"] / rc["static"]
    best_sweep = min(d["sweep"], key=lambda entry: entry[2])
    blended = [value / rd["static"] for _, w, value in d["sweep"] if 0 < w < 1]
    inside = min(d["replay_blocks"]) <= min(blended) and max(blended) <= max(d["replay_blocks"])
    return [
        f"Reading, dropless. The planner places the copies before a step, from the steps "
        f"before it; an expert's share of the routing correlates {d['persistence']['1']:.2f} "
        f"with the next step's and {d['persistence']['5']:.2f} with the step five later. "
        f"Planned from each step's own routing the excess load would be {hindsight_d:.3f}x "
        f"static's; planned from the planner's prediction it is {_replayed(d):.3f}x on the "
        f"same routing ({d['dynamic'] / d['static']:.3f}x in the dynamic run, whose routing "
        "drifts from the static run's by rounding), from the last step alone "
        f"{rd['last'] / rd['static']:.3f}x, from the mean alone {rd['mean'] / rd['static']:.3f}x, "
        f"with the best constants of the sweep ({best_sweep[0]:g}, {best_sweep[1]:g}) "
        f"{best_sweep[2] / rd['static']:.3f}x, and from a linear predictor fitted with "
        f"hindsight on the very steps it predicts {rd['fitted'] / rd['static']:.3f}x. What "
        "separates the planner from hindsight is the part of each step's routing that the "
        "steps before it do not predict, not the planning: a table made before the step "
        "cannot follow it, and only a choice made within the step from that step's counts "
        "(which the ragged dispatch all-gathers before its exchange), such as how each "
        "expert's rows split over its copies, could reach towards the hindsight figure "
        "(the next section). "
        f"The blends of the sweep (weights strictly between 0 and 1) span {min(blended):.3f}x"
        f"-{max(blended):.3f}x, {'inside' if inside else 'not inside'} the planner's own "
        f"range over blocks {_range(d['replay_blocks'])}; the planner keeps its constants "
        f"{SMOOTHING['tokens_per_expert']}.",
        "",
        f"Reading, capacity 1.25. Planned with each step's own routing, placement would drop "
        f"{hindsight_c:.3f}x static's assignments; the planner's prediction gets "
        f"{_replayed(c):.3f}x on the same routing. A copy adds its places to every routing "
        "group alike, while drops come from groups (one sequence each) in which an expert "
        "gets more assignments than its places, and no table of copies follows those: with "
        "hindsight of every step's routing, placement still does not halve the drops here.",
        "",
    ]


def write_report(result: dict, path: Path) -> str:
    path.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Dropless dispatch: capacity, padded and ragged; placement for dropless routing",
        "",
        *(f"Command ({part}): `{command}`" for part, command in result["commands"].items()),
        "",
        f"Machine: {result['host']}. Every figure is per device and per step unless it says "
        "otherwise. The presets as defined (no width or step count shrunk for the dispatch "
        "runs).",
        "",
    ]
    if "dispatch" in result:
        lines += [
            "## Bytes, FLOPs, time and memory on 8 fake CPU devices",
            "",
            "One process, layout 1 x 8 (data x expert), the byte corpus. *All-to-all "
            "operands*: what the step's all-to-alls carry here, read from the captured "
            "program (whole operands: for ragged, the pieces of the static form that XLA:CPU "
            "runs, since it cannot run `ragged_all_to_all`). *Moved by `ragged_all_to_all`*: "
            "every kept assignment's row once per exchange (dispatch and return, forward and "
            "backward), counted from each timed step's routing: what moves on GPU and TPU; "
            "capacity and padded buffers move whole on every backend, so there it is their "
            "operands. The ragged dispatch also all-gathers its counts first "
            f"({_kib_counts(result['dispatch'])} per step here, left out above). "
            "*Expert GFLOPs*: the routed experts' GEMMs forward and backward over the rows "
            "a grouped GEMM multiplies (GPU/TPU) and over what XLA:CPU multiplies "
            "(`ragged_dot` lowers there to a masked dense matmul per "
            "local slot: slots x receive buffer rows). *Compiled step GFLOPs*: XLA's cost "
            "analysis of the whole step. *Step*: "
            f"{result['repeats']} rounds of {result['steps']} steps per variant after "
            f"{WARMUP} untimed rounds, the variants interleaved (order reversed every other "
            "round) on the same batches; median and range of the round medians, and of each "
            "round's ratio (the machine was shared with other work: single timings spread "
            "widely, so compare the per-round ratios). *Temp*, *arguments + outputs*: "
            "`memory_analysis` of the compiled step. *Dropped*, *max/mean device load* (the "
            "routed assignments of the busiest device over the mean, per MoE layer): over "
            "the timed steps. Every variant starts "
            f"from the same state, trained {result['warm_steps']} steps by the padded "
            "dropless step first.",
            "",
        ]
        for name in PRESETS:
            if name in result["dispatch"]:
                lines += _dispatch_tables(name, result["dispatch"][name])
    if "sockets" in result:
        sockets = result["sockets"]
        calibration = sockets.get("calibration")
        where = (
            f"the emulated cluster: {SOCKET_HOSTS} hosts (network namespaces) x 4 devices, "
            f"joined by a {sockets['link_mbit']:g} Mbit/s link"
            if calibration
            else f"loopback: {SOCKET_HOSTS} processes x 4 devices"
        )
        lines += [
            "## Over the socket transport",
            "",
            f"On {where}; layout 1 x 8, so half of every exchange crosses to the other host. "
            "Schedule `none` over the socket transport; every variant's step in interleaved "
            f"rounds on the same batches ({sockets['rounds']} timed rounds after {WARMUP}), "
            f"from the same state trained {sockets['warm_steps']} steps first. "
            "*Sent to the other host*: the transport's own counter "
            "(`SocketTransport.traffic`), host 0's bytes over its 4 devices, per device and "
            "step: a ragged exchange's pieces are sent only up to their last routed row. "
            "*Whole*: what those pieces are untrimmed.",
            "",
        ]
        if calibration:
            lines += [
                f"Link calibrated: a {calibration['message_bytes'] / 2**20:.2f} MiB message at "
                f"{calibration['rate_fraction']:.1%} of the rate, {calibration['pieces']} "
                f"pieces {calibration['pieces_ratio']:.3f}x one message "
                f"({'passed' if calibration['passed'] else 'NOT passed'}).",
                "",
            ]
        for name in PRESETS:
            if name in sockets["measured"]:
                lines += _socket_table(name, sockets["measured"][name], bool(calibration))
    if "dispatch" in result:
        lines += ["## Reading", "", *_dispatch_reading(result)]
    if "placement" in result:
        lines += _placement_lines(result)
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


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
