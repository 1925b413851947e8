"""The fp8 section: one expert block (SwiGLU, Mixtral 8x7B's widths) forward and backward
with its GEMMs as each ``model.fp8`` recipe runs them, timed round-robin against
bfloat16."""

from __future__ import annotations

from typing import Any

from experiments.gpu_check.gemm import holds_fp8_gemm, time_calls
from experiments.gpu_check.setup import Budget, Setup, error_text, ms_text, ratio_text, spread_of
from experiments.shared.spread import round_ratios

FP8_RECIPES = ("none", "tensorwise", "blockwise")


def measure(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """One expert block forward and backward, its GEMMs in bfloat16 and in FP8."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmoe.layers.experts import Experts

    experts, tokens, d_model, hidden = setup.sizes.expert_block
    dtype = jnp.float32 if setup.dry else jnp.bfloat16
    flops = 3 * 2 * (3 * experts * tokens * d_model * hidden)  # 3 GEMMs, forward + 2 grads
    found.update(
        experts=experts, tokens=tokens, d_model=d_model, hidden=hidden, dtype=str(dtype.dtype),
        model_tflop=flops / 1e12, rounds=setup.sizes.rounds, recipes={},
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (experts, tokens, d_model), dtype)
    calls = {}
    for recipe in FP8_RECIPES:
        entry = found["recipes"][recipe] = {}
        block = Experts(
            experts, d_model, hidden, activation="swiglu", bias=False, fp8=recipe,
            dtype=dtype, rngs=nnx.Rngs(0),
        )  # fmt: skip
        graphdef, params = nnx.split(block)

        def loss(params, x, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32) ** 2)

        try:
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
            jax.block_until_ready(compiled(params, x))
        except Exception as error:
            entry["error"] = error_text(error)
            continue
        entry["fp8_gemm"] = holds_fp8_gemm(compiled.as_text())
        calls[recipe] = (compiled, (params, x))
    seconds = time_calls(calls, setup.sizes.rounds, setup.sizes.repeats, budget)
    for recipe, values in seconds.items():
        entry = found["recipes"][recipe]
        entry["seconds"] = spread_of(values)
        entry["tflops"] = spread_of([flops / s / 1e12 for s in values])
        if recipe != "none" and "none" in seconds:
            entry["over_bf16"] = spread_of(round_ratios(seconds["none"], values))
    return found


def report(found: dict[str, Any]) -> list[str]:
    if "recipes" not in found:
        return []
    lines = [
        f"{found['experts']} experts x {found['tokens']} tokens, d_model {found['d_model']}, "
        f"hidden {found['hidden']} (SwiGLU), {found['dtype']}; forward + backward "
        f"({found['model_tflop']:.2f} TFLOP a call), median [range] over up to "
        f"{found['rounds']} round-robin rounds. `over bf16`: bfloat16's time over this one's "
        "(above 1: faster).",
        "",
        "| model.fp8 | ms | TFLOP/s | over bf16 | FP8 GEMM |",
        "|---|---|---|---|---|",
    ]
    for recipe, entry in found["recipes"].items():
        if "error" in entry:
            lines.append(f"| {recipe} | {entry['error'].splitlines()[0][:120]} ||||")
            continue
        fp8 = {True: "yes", False: "no", None: "-"}[entry.get("fp8_gemm")]
        lines.append(
            f"| {recipe} | {ms_text(entry.get('seconds'))} | {ratio_text(entry.get('tflops'))} | "
            f"{ratio_text(entry.get('over_bf16'))} | {fp8} |"
        )
    return [*lines, ""]
