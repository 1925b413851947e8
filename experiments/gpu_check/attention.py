"""The attention section: the attention cores (cuDNN's flash attention, blockwise at two
block sizes, dense below a size of its scores) against the dense core in float32, and
their forward plus backward times, round-robin, without and with packed documents; and
whether the backward pass runs a flash core's forward pass again under ``model.recompute
matmuls``'s policy (0: the policy keeps its residuals)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from experiments.gpu_check.setup import (
    Budget,
    Setup,
    Sizes,
    error_text,
    ms_text,
    ratio_text,
    spread_of,
)
from experiments.shared.spread import round_ratios


def measure(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """The attention cores against the float32 dense core, and their fwd+bwd times."""
    import jax.numpy as jnp

    from jaxmoe.layers.attention_core import cudnn_takes, resolve_core

    sizes = setup.sizes
    batch, length, heads, kv_heads, head_dim = sizes.attention
    dtype = jnp.dtype(sizes.attention_dtype)
    found.update(
        shape=dict(batch=batch, seq=length, heads=heads, kv_heads=kv_heads, head_dim=head_dim),
        dtype=dtype.name,
        causal=True,
        auto=resolve_core("auto", dtype=dtype, head_dim=head_dim).kind,
        cudnn_refusal=cudnn_takes(dtype, head_dim),
        rounds=sizes.rounds,
        repeats=sizes.repeats,
        variants={},
    )
    operands = _attention_operands(sizes.attention, dtype)
    packed = jnp.asarray(_segment_ids(batch, length))
    for variant, segments in (("causal", None), ("packed", packed)):
        found["variants"][variant] = entry = {}
        if segments is not None:
            entry["documents"] = int(segments.max()) + 1
        _attention_variant(setup, budget, operands, segments, entry)
    found["forwards_under_matmuls"] = _forwards_under_matmuls(setup, operands)
    return found


# The primitive of each flash core's forward pass, as traced: cuDNN's fused kernel, the
# blockwise core's loop over tiles (its backward pass is a loop too: what counts is the
# loops a policy adds to the gradient without one).
FORWARD_PRIMITIVES = {"cudnn": "dot_product_attention_fwd_wrapper", "blockwise": "scan"}


def _forwards_under_matmuls(setup: Setup, operands: tuple) -> dict[str, Any]:
    """For each flash core that runs here: how many more of its forward passes the traced
    gradient of a block-like function holds checkpointed with ``"matmuls"``'s policy than
    without a checkpoint (the passes its backward pass runs again)."""
    import jax

    from jaxmoe.layers.attention_core import cudnn_takes
    from jaxmoe.layers.recompute import POLICIES

    cores, _ = _cores(setup, cudnn_takes(operands[0].dtype, operands[0].shape[-1]))
    again: dict[str, Any] = {}
    for name, core in cores.items():
        kind = name.split("_")[0]
        if kind not in FORWARD_PRIMITIVES or kind in again:
            continue

        def block(q, k, v, core=core):
            return (core(q, k, v).astype(q.dtype) ** 2).sum()

        def forwards(function: Callable, kind: str = kind) -> int:
            traced = jax.make_jaxpr(jax.grad(function, argnums=(0, 1, 2)))(*operands[:3])
            return _count(traced.jaxpr, FORWARD_PRIMITIVES[kind])

        try:
            again[kind] = forwards(jax.checkpoint(block, policy=POLICIES["matmuls"])) - forwards(
                block
            )
        except Exception as error:  # a core that cannot be traced here is a finding
            again[kind] = error_text(error)
    return again


def _count(jaxpr: Any, primitive: str) -> int:
    """Equations of ``primitive`` in ``jaxpr`` and every jaxpr nested in it (a loop counts
    once, not its body's)."""
    from jax.extend.core import jaxprs_in_params

    found = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found += 1
        else:
            found += sum(_count(inner, primitive) for inner in jaxprs_in_params(eqn.params))
    return found


def _attention_operands(shape: tuple[int, ...], dtype: Any) -> tuple[Any, ...]:
    """Query, key, value and a cotangent of the output, random and fixed."""
    import jax

    batch, length, heads, kv_heads, head_dim = shape
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [
        (batch, length, heads, head_dim),
        (batch, length, kv_heads, head_dim),
        (batch, length, kv_heads, head_dim),
        (batch, length, heads, head_dim),
    ]
    return tuple(
        jax.random.normal(key, s, jax.numpy.float32).astype(dtype)
        for key, s in zip(keys, shapes, strict=True)
    )


def _segment_ids(batch: int, length: int) -> Any:
    """Packed documents: each row cut at fixed fractions of its length into 5 documents."""
    import numpy as np

    cuts = np.array([0.13, 0.37, 0.5, 0.81]) * length
    ids = np.searchsorted(cuts.astype(int), np.arange(length), side="right")
    return np.broadcast_to(ids, (batch, length)).astype(np.int32)


def _cores(setup: Setup, refusal: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The cores to run by name, and those left out with why."""
    from jaxmoe.layers.attention_core import AttentionCore

    sizes = setup.sizes
    cores, skipped = {}, {}
    if refusal is None:
        cores["cudnn"] = AttentionCore("cudnn")
    else:
        skipped["cudnn"] = refusal
    for block in sizes.blocks:
        cores[f"blockwise_{block}"] = AttentionCore("blockwise", block=block)
    batch, length, heads, _, _ = sizes.attention
    scores = batch * heads * length * length * 4
    if scores <= sizes.dense_max_score_bytes:
        cores["dense"] = AttentionCore("dense")
    else:
        skipped["dense"] = (
            f"its float32 scores take {scores / 2**30:.1f} GiB, over the "
            f"{sizes.dense_max_score_bytes / 2**30:.1f} GiB this check allows"
        )
    return cores, skipped


def _fwd_bwd(core: Any) -> Callable:
    """``(q, k, v, cotangent, segment_ids) -> (out, dq, dk, dv)``, jit-wrapped."""
    import jax

    def run(query, key, value, cotangent, segment_ids):
        def attend(q, k, v):
            return core(q, k, v, segment_ids=segment_ids)

        out, pullback = jax.vjp(attend, query, key, value)
        return (out, *pullback(cotangent))

    return jax.jit(run)


def _attention_variant(
    setup: Setup, budget: Budget, operands: tuple, segments: Any, entry: dict[str, Any]
) -> None:
    import jax
    import jax.numpy as jnp

    from jaxmoe.layers.attention_core import AttentionCore, cudnn_takes

    sizes = setup.sizes
    cores, skipped = _cores(setup, cudnn_takes(operands[0].dtype, operands[0].shape[-1]))
    entry["skipped"] = skipped
    entry["cores"] = results = {}
    reference = None
    if "dense" in cores:  # the dense core fits: so does its float32 run
        try:
            with jax.default_matmul_precision("highest"):
                wide = [x.astype(jnp.float32) for x in operands]
                reference = _fwd_bwd(AttentionCore("dense"))(*wide, segments)
                jax.block_until_ready(reference)
        except Exception as error:  # then the cores are timed, not compared
            entry["reference_error"] = error_text(error)
    entry["reference"] = "dense core in float32, highest precision" if reference else None
    compiled = {}
    for name, core in cores.items():
        results[name] = result = {}
        if not budget.fits(10):
            result["error"] = "not run: the section's time ran out"
            continue
        try:
            compiled[name] = _compile_core(core, operands, segments, reference, result)
        except Exception as error:  # a core that cannot run here is a finding
            result["error"] = error_text(error)
    _time_cores(compiled, (*operands, segments), sizes, budget, results)
    baseline = "cudnn" if results.get("cudnn", {}).get("seconds") else None
    baseline = baseline or next((n for n, r in results.items() if r.get("seconds")), None)
    entry["ratio_to"] = baseline
    for result in results.values():
        if baseline and result.get("seconds"):
            ratios = round_ratios(
                result["seconds"]["values"], results[baseline]["seconds"]["values"]
            )
            result["ratio"] = spread_of(ratios)


def _compile_core(
    core: Any, operands: tuple, segments: Any, reference: Any, result: dict[str, Any]
) -> Callable:
    """Compile one core's fwd+bwd, run it once, and its largest differences from the
    reference (output and each gradient)."""
    import jax
    import jax.numpy as jnp

    began = time.perf_counter()
    compiled = _fwd_bwd(core).lower(*operands, segments).compile()
    result["compile_s"] = round(time.perf_counter() - began, 2)
    result["fused_cudnn_kernel"] = "cudnn$fmha" in compiled.as_text()
    outputs = jax.block_until_ready(compiled(*operands, segments))
    if reference is not None:
        names = ("out", "dq", "dk", "dv")
        result["max_abs_diff"] = {
            n: float(jnp.max(jnp.abs(o.astype(jnp.float32) - r)))
            for n, o, r in zip(names, outputs, reference, strict=True)
        }
        result["reference_max_abs"] = {
            n: float(jnp.max(jnp.abs(r))) for n, r in zip(names, reference, strict=True)
        }
    return compiled


def _time_cores(
    compiled: dict[str, Callable],
    args: tuple,
    sizes: Sizes,
    budget: Budget,
    results: dict[str, dict],
) -> None:
    """Seconds per fwd+bwd call of each core, the cores round-robin (``repeats`` calls
    each per round), rounds while the section's time lasts (one at least)."""
    import jax

    seconds: dict[str, list[float]] = {name: [] for name in compiled}
    for round_index in range(sizes.rounds):
        if round_index and not budget.fits(5):
            break
        for name, function in compiled.items():
            began = time.perf_counter()
            for _ in range(sizes.repeats):
                outputs = function(*args)
            jax.block_until_ready(outputs)
            seconds[name].append((time.perf_counter() - began) / sizes.repeats)
    for name, values in seconds.items():
        if values:
            results[name]["seconds"] = spread_of(values)


def report(found: dict[str, Any]) -> list[str]:
    if "shape" not in found:
        return []
    shape = found["shape"]
    lines = [
        f"Batch {shape['batch']}, {shape['seq']} tokens, {shape['heads']} query heads over "
        f"{shape['kv_heads']} key/value heads of {shape['head_dim']}, {found['dtype']}, causal; "
        f"`auto` takes {found['auto']}. Forward + backward, median [range] over up to "
        f"{found['rounds']} round-robin rounds of {found['repeats']} calls; differences "
        "are the largest absolute ones from the dense core in float32.",
        "",
    ]
    for variant, entry in found["variants"].items():
        packed = f" ({entry['documents']} documents a row)" if "documents" in entry else ""
        lines += [
            f"**{variant}**{packed}",
            "",
            f"| core | compile s | fwd+bwd ms | / {entry.get('ratio_to') or '-'} | out | dq | "
            "dk | dv | cuDNN kernel |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, result in entry.get("cores", {}).items():
            if "error" in result and "compile_s" not in result:
                lines.append(f"| {name} | {result['error'].splitlines()[0][:120]} |||||||| ")
                continue
            diffs = result.get("max_abs_diff", {})
            cells = [f"{diffs[n]:.2e}" if n in diffs else "-" for n in ("out", "dq", "dk", "dv")]
            lines.append(
                f"| {name} | {result['compile_s']:.1f} | {ms_text(result.get('seconds'))} | "
                f"{ratio_text(result.get('ratio'))} | {' | '.join(cells)} | "
                f"{'yes' if result['fused_cudnn_kernel'] else 'no'} |"
            )
        lines += [f"- {name} not run: {why}" for name, why in entry.get("skipped", {}).items()]
        lines.append("")
    forwards = found.get("forwards_under_matmuls", {})
    if forwards:
        lines += [
            "Forward passes of each flash core that the backward pass runs again under "
            "`model.recompute matmuls`'s policy (0: its residuals kept): "
            + ", ".join(f"{kind} {count}" for kind, count in forwards.items()),
            "",
        ]
    return lines
