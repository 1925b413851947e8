"""The step section: one training step on one device of a Mixtral-style model at the
largest batch the memory walk fits: its time, tokens per second and MFU, and the cost
model's estimate of the step and of one block against them."""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

from experiments.gpu_check.setup import Budget, Setup, Sizes, error_text, ms_text, spread_of
from experiments.shared.spread import Spread
from experiments.shared.token_batches import random_token_batches

STEP_PROFILE = "h100-8x-nvlink-3200g"


def measure(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """One device's training step: time, tokens/s, MFU, and the cost model's estimate."""
    from jaxmoe.parallel.mesh import build_mesh

    sizes = setup.sizes
    mesh = build_mesh(step_config(sizes, batch=1).parallel, [setup.device])
    batch, fit, captured = fit_batch(mesh, sizes)
    config = step_config(sizes, batch)
    model, moe = config.model, config.moe
    found.update(
        preset=sizes.step_preset,
        model=dict(
            d_model=model.d_model,
            layers=model.num_layers,
            d_ff=model.d_ff,
            heads=model.num_heads,
            kv_heads=model.kv_heads,
            seq_len=model.seq_len,
            vocab=model.vocab_size,
            dtype=model.dtype,
            attention=model.attention,
            attention_core=_core_kind(model),
            experts=moe.num_experts,
            top_k=moe.top_k,
            capacity_factor=moe.capacity_factor,
        ),
        layout="parallel data 1 x expert 1 (one device)",
        batch=batch,
        tokens_per_step=batch * model.seq_len,
        memory_fit=fit,
    )
    run, program, sharded = captured.get(batch) or _capture(config, mesh)
    try:
        found["estimate"] = _estimate(run, program, mesh)
    except Exception as error:  # the step is still measured
        found["estimate"] = {"error": error_text(error)}
    if not budget.fits(20):
        found["measured"] = {"error": "not run: the section's time ran out"}
        return found
    found["measured"] = measured = {}
    _measure_step(setup, budget, run, sharded, measured)
    _compare(found, config, setup.device.device_kind)
    return found


def _core_kind(model: Any) -> str:
    """The attention core ``model.attention`` resolves to on this backend."""
    import jax.numpy as jnp

    from jaxmoe.layers.attention_core import resolve_core

    dtype, head_dim = jnp.dtype(model.dtype), model.attention_head_dim
    return resolve_core(model.attention, dtype=dtype, head_dim=head_dim).kind


def step_config(sizes: Sizes, batch: int) -> Any:
    from jaxmoe.presets import preset

    config = preset(sizes.step_preset)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, **sizes.step_model),
        parallel=dataclasses.replace(config.parallel, data=1, expert=1),
        train=dataclasses.replace(config.train, batch_size=batch, microbatches=1),
        schedule=dataclasses.replace(config.schedule, name="none", profile=STEP_PROFILE),
    )


def _capture(config: Any, mesh: Any) -> tuple[Any, Any, Any]:
    """The resolved run, its captured per-device program and its sharded step."""
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import capture_train_step

    run = resolve(config, mesh)
    program, sharded = capture_train_step(run)
    return run, program, sharded


def fit_batch(mesh: Any, sizes: Sizes) -> tuple[int, dict[str, Any], dict]:
    """The largest candidate batch whose step the memory walk fits in the budget, each
    candidate walked from the smallest up to the first over the budget (the peak need not
    grow with the batch at first: with few rows it is the optimizer's update); how it was
    found; the captures of the batches that fit (by batch)."""
    from jaxmoe.plan.memory import step_memory

    programs, walked = {}, {}
    method = (
        "jaxmoe.plan.memory.step_memory at each candidate batch, smallest first, up to the "
        "first over the budget"
    )
    try:
        for rows in sorted(sizes.step_batches):
            captured = _capture(step_config(sizes, rows), mesh)
            walked[rows] = step_memory(captured[1], captured[0].state_shapes).total
            if walked[rows] > sizes.step_memory_bytes:
                break
            programs[rows] = captured
    except Exception as error:  # then the batch the walk gave on a CPU host
        fit = {"method": method, "error": error_text(error), "fits": None}
        return sizes.step_batch_unwalked, fit, programs
    batch = max(programs, default=min(sizes.step_batches))
    fit = {
        "method": method,
        "budget_bytes": sizes.step_memory_bytes,
        "walked_bytes": walked,
        "estimated_bytes": walked[batch],
        "fits": bool(programs),
    }
    return batch, fit, programs


def _estimate(run: Any, program: Any, mesh: Any) -> dict[str, Any]:
    """The cost model's seconds summed over the program's ops: whole, by phase, by block."""
    import scheduling

    cost = scheduling.cost_model(run.policy, mesh, program)
    total, phases, blocks = 0.0, {}, {}
    for op in program.ops:
        seconds = cost.seconds(op)
        total += seconds
        phases[op.phase.value] = phases.get(op.phase.value, 0.0) + seconds
        layer = re.match(r"layer_(\d+)(?:/|$)", op.layer)
        if layer:
            blocks[int(layer.group(1))] = blocks.get(int(layer.group(1)), 0.0) + seconds
    return {
        "profile": STEP_PROFILE,
        "ops": len(program.ops),
        "step_s": total,
        "phases_s": phases,
        "blocks_s": [blocks[i] for i in sorted(blocks)],
        "block_s": sum(blocks.values()) / max(1, len(blocks)),
    }


def _measure_step(
    setup: Setup, budget: Budget, run: Any, sharded: Any, measured: dict[str, Any]
) -> None:
    """Compile the step, warm it up, then time each step to completion."""
    import jax

    from jaxmoe.train.state import init_train_state

    sizes, config = setup.sizes, run.config
    state = init_train_state(run)
    batches = random_token_batches(run.config, run.on_mesh, 3)
    began = time.perf_counter()
    compiled = sharded.jit().lower(state, batches[0]).compile()
    measured["compile_s"] = round(time.perf_counter() - began, 2)
    measured["compiled_memory"] = _compiled_memory(compiled)
    for index in range(sizes.warmup):
        state, metrics = compiled(state, batches[index % len(batches)])
    jax.block_until_ready(metrics)
    seconds, dropped = [], []
    for index in range(sizes.steps):
        if index >= 2 and not budget.fits(3):
            break
        began = time.perf_counter()
        state, metrics = compiled(state, batches[index % len(batches)])
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - began)
        dropped.append(float(metrics.get("dropped_fraction", 0.0)))
    measured["step_s"] = spread_of(seconds)
    measured["device_memory"] = _device_memory(setup.device)
    measured["dropped_fraction"] = sum(dropped) / len(dropped)
    measured["tokens_per_s"] = (
        config.train.batch_size * config.model.seq_len / Spread.of(seconds).median
    )
    if not budget.fits(15):
        measured["profile_error"] = "not run: the section's time ran out"
        return
    try:
        measured["profile"] = _profiled_blocks(compiled, state, batches)
    except Exception as error:  # the step's own figures stand without it
        measured["profile_error"] = error_text(error)


def _compiled_memory(compiled: Any) -> dict[str, int]:
    """Bytes of the compiled step by XLA's memory analysis, and its peak as the memory
    tests count it (arguments + outputs - aliased + temporaries)."""
    analysis = compiled.memory_analysis()
    found = {
        name: int(getattr(analysis, f"{name}_size_in_bytes"))
        for name in ("argument", "output", "alias", "temp")
    }
    found["peak"] = found["argument"] + found["output"] - found["alias"] + found["temp"]
    return found


def _device_memory(device: Any) -> dict[str, int] | None:
    """The device allocator's limit and its peak in use after the timed steps (None where
    the backend keeps no statistics, as XLA:CPU's)."""
    stats = device.memory_stats()
    if not stats:
        return None
    wanted = ("bytes_limit", "peak_bytes_in_use", "bytes_reservable_limit")
    return {name: int(stats[name]) for name in wanted if name in stats}


def _profiled_blocks(compiled: Any, state: Any, batches: list[Any]) -> dict[str, Any]:
    """Device time per block from a ``jax.profiler`` trace of two steps: each executed XLA
    op counted under the ``layer_<i>`` its own op_name names (ops under none: the
    embedding, head, loss and optimizer), and all of them, per step."""
    import tempfile

    import jax

    import scheduling

    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for index in range(2):
                state, metrics = compiled(state, batches[index % len(batches)])
            jax.block_until_ready(metrics)
        ops = scheduling.read_trace(directory)
    keys = scheduling.hlo_op_keys(compiled.as_text())
    blocks: dict[int, float] = {}
    for name, seconds in ops.seconds.items():
        own = keys[name].own if name in keys else ()
        layer = re.search(r"\blayer_(\d+)\b", own[0][0]) if own else None
        if layer:
            blocks[int(layer.group(1))] = blocks.get(int(layer.group(1)), 0.0) + seconds
    if not blocks:
        raise ValueError("no profiled op names a layer")
    return {
        "steps": ops.steps,
        "ops_s": sum(ops.seconds.values()),
        "blocks_s": [blocks[i] for i in sorted(blocks)],
        "block_s": sum(blocks.values()) / len(blocks),
    }


def _compare(found: dict[str, Any], config: Any, device_kind: str) -> None:
    """MFU, and the estimate over the measured time (the step, and one block)."""
    from jaxmoe.plan.mfu import datasheet_peak_tflops, mfu
    from jaxmoe.plan.model_flops import model_flops

    measured, estimate = found["measured"], found["estimate"]
    median = measured["step_s"]["median"]
    flops = model_flops(config)
    found["model_flops_per_step"] = flops.train_step()
    peak = datasheet_peak_tflops(device_kind, config.model.dtype)
    found["peak_tflops"] = peak
    if peak:
        found["mfu"] = mfu(flops.train_step(), median, 1, peak * 1e12)
        dropped = flops.train_step(measured["dropped_fraction"])
        found["mfu_dropped_not_counted"] = mfu(dropped, median, 1, peak * 1e12)
    if "error" in estimate:
        return
    profile = measured.get("profile")
    if profile:
        block = profile["block_s"]
        block_is = (
            f"profiled: the device time of the ops under each layer, mean over the "
            f"{len(profile['blocks_s'])} blocks; every profiled op "
            f"{profile['ops_s'] * 1e3:.3f} ms a step"
        )
    else:
        block = median / config.model.num_layers
        block_is = (
            "derived: measured step time / layers (it includes the embedding, the head, "
            "the loss and the optimizer)"
        )
    found["comparison"] = {
        "step_estimate_over_measured": estimate["step_s"] / median,
        "block_measured_s": block,
        "block_measured_is": block_is,
        "block_estimate_over_measured": estimate["block_s"] / block,
    }


def report(found: dict[str, Any]) -> list[str]:
    if "model" not in found:
        return []
    model = found["model"]
    lines = [
        f"Preset `{found['preset']}` at d_model {model['d_model']}, {model['layers']} layers, "
        f"d_ff {model['d_ff']}, {model['experts']} experts top-{model['top_k']}, "
        f"{model['seq_len']} tokens a row, {model['dtype']}, attention {model['attention']} "
        f"({model['attention_core']}); {found['layout']}; batch {found['batch']} "
        f"({found['tokens_per_step']:,} tokens), {fit_text(found['memory_fit'])}.",
        "",
    ]
    estimate, measured = found.get("estimate", {}), found.get("measured", {})
    if "step_s" in estimate:
        lines.append(
            f"- cost model ({estimate['profile']}): step {estimate['step_s'] * 1e3:.2f} ms, "
            f"one block {estimate['block_s'] * 1e3:.3f} ms (mean over the blocks)"
        )
    else:
        lines.append(f"- cost model: {estimate.get('error', 'no estimate').splitlines()[0]}")
    if "step_s" not in measured:
        error = measured.get("error", "not measured")
        return [*lines, f"- measured: {error.splitlines()[0]}", ""]
    mfu = f"{found['mfu']:.1%}" if "mfu" in found else "- (no datasheet peak for this device)"
    lines.append(
        f"- measured: compile {measured['compile_s']:.1f} s; "
        f"step {ms_text(measured['step_s'])} ms; "
        f"{measured['tokens_per_s']:,.0f} tokens/s; MFU {mfu}; dropped fraction "
        f"{measured['dropped_fraction']:.3f}"
    )
    lines.extend(memory_lines(found))
    if "profile_error" in measured:
        lines.append(f"- profile: {measured['profile_error'].splitlines()[0]}")
    comparison = found.get("comparison")
    if comparison:
        lines.append(
            f"- estimate / measured: step {comparison['step_estimate_over_measured']:.2f}; "
            f"block {comparison['block_estimate_over_measured']:.2f}, the measured block "
            f"{comparison['block_measured_s'] * 1e3:.3f} ms ({comparison['block_measured_is']})"
        )
    return [*lines, ""]


def memory_lines(found: dict[str, Any]) -> list[str]:
    """The compiled step's memory against the memory walk's estimate, and what the
    device's allocator allows and held."""
    measured, fit = found["measured"], found["memory_fit"]
    compiled = measured.get("compiled_memory")
    if not compiled:
        return []
    line = (
        f"- memory: XLA's compiled step {compiled['peak'] / 1e9:.2f} GB (arguments "
        f"{compiled['argument'] / 1e9:.2f} + outputs {compiled['output'] / 1e9:.2f} - aliased "
        f"{compiled['alias'] / 1e9:.2f} + temporaries {compiled['temp'] / 1e9:.2f})"
    )
    if "estimated_bytes" in fit:
        line += f"; the memory walk's over it {fit['estimated_bytes'] / compiled['peak']:.3f}"
    device = measured.get("device_memory")
    if device and "bytes_limit" in device:
        line += f"; the allocator's limit {device['bytes_limit'] / 1e9:.2f} GB"
        if "peak_bytes_in_use" in device:
            line += f", its peak in use {device['peak_bytes_in_use'] / 1e9:.2f} GB"
    return [line]


def fit_text(fit: dict[str, Any]) -> str:
    if "error" in fit:
        return f"the memory walk failed (`{fit['error'].splitlines()[0]}`): a set batch"
    return (
        f"the memory walk's estimate {fit['estimated_bytes'] / 1e9:.2f} GB of a "
        f"{fit['budget_bytes'] / 1e9:g} GB budget"
        + ("" if fit["fits"] else " (not even the smallest batch fits)")
    )
