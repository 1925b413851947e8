"""Each memory-saving option of a small model on 8 CPU devices (part 2 of
:mod:`experiments.scale_eval`): XLA:CPU's compiled memory beside the memory walk of
:mod:`jaxmoe.plan.memory` (as XLA:CPU and as XLA:GPU hold it) and the step time over
repeated steps, each option against the plain step."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from experiments.shared.compiled_memory import compiled_peak
from jaxmoe.train.resolved import resolve

CPU_DEVICES = 8
# The small model of part 2: 4 MoE layers of 8 experts (top 2), width 128, 32 positions,
# 32 sequences per step, float32 (its state about half of the plain step's peak); its
# options each against the plain step.
CPU_MODEL = dict(d_model=128, num_heads=4, num_layers=4, d_ff=512, seq_len=32, moe_every=1)
CPU_OPTIONS: dict[str, dict[str, Any]] = {
    "plain (data 2 x expert 4)": {},
    "ZeRO-1": {"train": {"zero": 1}},
    "ZeRO-3": {"train": {"zero": 3}},
    "recompute matmuls": {"model": {"recompute": "matmuls"}},
    "recompute layer": {"model": {"recompute": "layer"}},
    "4 microbatches": {"train": {"microbatches": 4}},
    "pipeline 2, 4 microbatches (data 2 x expert 2 per stage)": {
        "train": {"microbatches": 4},
        "parallel": {"data": 2, "expert": 2, "pipeline": 2},
    },
    "pipeline 2, ZeRO-1, 4 microbatches": {
        "train": {"microbatches": 4, "zero": 1},
        "parallel": {"data": 2, "expert": 2, "pipeline": 2},
    },
    "pipeline 2, 2 virtual, 4 microbatches": {
        "train": {"microbatches": 4},
        "parallel": {"data": 2, "expert": 2, "pipeline": 2, "virtual_stages": 2},
    },
}


def measure_options_on_cpu(repeats: int) -> list[dict[str, Any]]:
    """Part 2, in a process of 8 CPU devices: each option's compiled memory, memory walk
    and step time (``repeats`` timed steps after two untimed ones)."""
    import jax
    import numpy as np

    from jaxmoe.config import Config
    from jaxmoe.parallel.mesh import build_mesh, token_spec
    from jaxmoe.plan.memory import step_memory
    from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step
    from jaxmoe.train.state import init_train_state

    rows = []
    for name, fields in CPU_OPTIONS.items():
        values = {
            "model": {**CPU_MODEL, **fields.get("model", {})},
            "moe": {"num_experts": 8, "top_k": 2, "capacity_factor": 1.0},
            "parallel": fields.get("parallel", {"data": 2, "expert": 4}),
            "train": {"batch_size": 32, "warmup_steps": 1, **fields.get("train", {})},
        }
        config = Config.from_dict(values)
        mesh = build_mesh(config.parallel)
        started = time.perf_counter()
        step = scheduled_train_step(resolve(config, mesh)).compile()
        compile_seconds = time.perf_counter() - started
        analysis = step.memory_analysis()
        peak = compiled_peak(analysis)
        program, _ = capture_train_step(resolve(config, mesh))
        state_shapes = resolve(config).state_shapes
        walk = step_memory(program, state_shapes, keeps_barriers=True)
        merged = step_memory(program, state_shapes, keeps_barriers=False)
        state = init_train_state(resolve(config, mesh))
        rng = np.random.default_rng(0)
        sharding = jax.sharding.NamedSharding(mesh, token_spec(mesh))
        times = []
        for index in range(repeats + 2):
            tokens = rng.integers(0, config.model.vocab_size, (32, config.model.seq_len + 1))
            batch = jax.device_put(tokens.astype(np.int32), sharding)
            began = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            if index >= 2:
                times.append(time.perf_counter() - began)
        rows.append(
            {
                "name": name,
                "xla": peak,
                "temp": analysis.temp_size_in_bytes,
                "walk": walk.total,
                "walk_merged": merged.total,
                "jax": jax.__version__,
                "times": times,
                "compile": compile_seconds,
            }
        )
        print(f"{name}: {peak / 1e6:.2f} MB, {np.median(times) * 1e3:.1f} ms", flush=True)
    return rows


def cpu_rows(measured: Sequence[dict[str, Any]]) -> list[str]:
    from experiments.shared.spread import Spread

    base = measured[0]
    base_time = Spread.of(base["times"]).median
    lines = [
        "| option | XLA:CPU peak MB | against plain | walk MB (its / XLA's) | "
        "walk, barriers dropped before CSE, MB | step ms, median [min-max] | against plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in measured:
        spread = Spread.of(row["times"])
        lines.append(
            f"| {row['name']} | {row['xla'] / 1e6:.2f} | {row['xla'] / base['xla']:.2f} | "
            f"{row['walk'] / 1e6:.2f} ({row['walk'] / row['xla']:.2f}) | "
            f"{row['walk_merged'] / 1e6:.2f} | {spread.format()} | "
            f"{spread.median / base_time:.2f} |"
        )
    return lines
