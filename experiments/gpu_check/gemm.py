"""The gemm section: bfloat16 products (square, and MoE expert shapes) in TFLOP/s and as a
fraction of the device's datasheet peak, the same products with float8 operands beside
them, round-robin; and the timing of compiled calls the fp8 section shares."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

from experiments.gpu_check.setup import Budget, Setup, error_text, ratio_text, spread_of
from experiments.shared.spread import round_ratios


def measure(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """bfloat16 and float8 products: TFLOP/s, fraction of the peak, FP8 against bf16."""
    from jaxmoe.plan.mfu import datasheet_peak_tflops

    peak = datasheet_peak_tflops(setup.device.device_kind, "bfloat16")
    found.update(
        peak_bf16_tflops=peak,
        peak_source=f"datasheet dense peak of {setup.device.device_kind}" if peak else None,
        timed="a chain of products x @ up @ down per call, bf16 and fp8 round-robin",
        rounds=setup.sizes.gemm_rounds,
        shapes=[],
    )
    for m, k, n in setup.sizes.gemms:
        entry = {"m": m, "k": k, "n": n}
        found["shapes"].append(entry)
        if not budget.fits(4):
            entry["error"] = "not run: the section's time ran out"
            continue
        try:
            _gemm_shape(setup, budget, m, k, n, peak, entry)
        except Exception as error:
            entry["error"] = error_text(error)
    return found


def _gemm_chain(dtype: Any, pairs: int) -> Callable:
    """``x [m, k] -> (x @ up @ down) repeated``: ``pairs`` dependent pairs of products,
    float8 ones accumulated in float32 and cast back to float8."""
    import jax
    import jax.numpy as jnp

    dims = (((1,), (0,)), ((), ()))
    eight = jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)

    def product(a, b):
        if not eight:
            return a @ b
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(dtype)

    def chain(x, up, down):
        for _ in range(pairs):
            x = product(product(x, up), down)
        return x

    return jax.jit(chain)


def _gemm_operands(m: int, k: int, n: int) -> tuple[Any, Any, Any]:
    """``x [m, k]``, ``up [k, n]``, ``down [n, k]`` in float32, scaled to keep unit size."""
    import jax

    keys = jax.random.split(jax.random.key(1), 3)
    normal = jax.random.normal
    return (
        normal(keys[0], (m, k)),
        normal(keys[1], (k, n)) / math.sqrt(k),
        normal(keys[2], (n, k)) / math.sqrt(n),
    )


def _gemm_shape(
    setup: Setup, budget: Budget, m: int, k: int, n: int, peak: float | None, entry: dict
) -> None:
    import jax
    import jax.numpy as jnp

    sizes = setup.sizes
    pair_flops = 2 * (2 * m * k * n)
    pairs = max(1, min(32, round(sizes.gemm_call_flops / pair_flops)))
    flops = pairs * pair_flops
    repeats = max(1, math.ceil(sizes.gemm_measure_flops / flops))
    entry.update(products_per_call=2 * pairs, calls_per_measurement=repeats)
    wide = _gemm_operands(m, k, n)
    calls = {}
    for name, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        operands = tuple(x.astype(dtype) for x in wide)
        try:
            compiled = _gemm_chain(dtype, pairs).lower(*operands).compile()
            jax.block_until_ready(compiled(*operands))
            calls[name] = (compiled, operands)
        except Exception as error:
            entry[f"{name}_error"] = error_text(error)
    for name, (compiled, _) in calls.items():
        entry[f"{name}_kernels"] = _gemm_kernels(compiled.as_text())
    if "fp8" in calls:
        entry["fp8_gemm"] = holds_fp8_gemm(calls["fp8"][0].as_text())
        entry["fp8_max_rel_error"] = _fp8_error(*wide[:2])
    seconds = time_calls(calls, sizes.gemm_rounds, repeats, budget)
    for name, values in seconds.items():
        entry[f"{name}_tflops"] = spread_of([flops / s / 1e12 for s in values])
        if peak and name == "bf16":
            entry["bf16_of_peak"] = entry["bf16_tflops"]["median"] / peak
    if len(seconds) == 2:
        entry["fp8_over_bf16"] = spread_of(round_ratios(seconds["bf16"], seconds["fp8"]))


def time_calls(
    calls: dict[str, tuple], rounds: int, repeats: int, budget: Budget
) -> dict[str, list[float]]:
    """Seconds per call of each compiled function (``repeats`` calls queued, then waited
    for), the functions round-robin, rounds while the section's time lasts."""
    import jax

    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(rounds):
        if round_index and not budget.fits(3):
            break
        for name, (compiled, operands) in calls.items():
            began = time.perf_counter()
            for _ in range(repeats):
                result = compiled(*operands)
            jax.block_until_ready(result)
            seconds[name].append((time.perf_counter() - began) / repeats)
    return {name: values for name, values in seconds.items() if values}


def _gemm_kernels(hlo: str) -> list[str]:
    """The library calls and GEMM fusions of an optimized module."""
    kernels = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    kernels |= {kind for kind in ("__triton_gemm", "__cudnn$fusion") if kind in hlo}
    return sorted(kernels)


def holds_fp8_gemm(hlo: str) -> bool:
    """Whether a GEMM of the module takes float8 operands: cuBLASLt's FP8 GEMM (its target
    names the type; its operands' types are on other lines), or a Triton or cuDNN fusion
    whose line holds a float8 type."""
    if "__cublas$lt$matmul$f8" in hlo:
        return True
    gemm = re.compile(r"__triton_gemm|__cudnn\$fusion")
    return any("f8e4m3fn" in line and gemm.search(line) for line in hlo.splitlines())


def _fp8_error(x: Any, up: Any) -> float:
    """The float8 product's largest difference from the bfloat16 one, over the latter's
    largest magnitude (both accumulated in float32)."""
    import jax
    import jax.numpy as jnp

    dims = (((1,), (0,)), ((), ()))

    @jax.jit
    def error(x, up):
        def product(dtype):
            a, b = x.astype(dtype), up.astype(dtype)
            return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

        exact = product(jnp.bfloat16)
        return jnp.max(jnp.abs(product(jnp.float8_e4m3fn) - exact)) / jnp.max(jnp.abs(exact))

    return float(error(x, up))


def report(found: dict[str, Any]) -> list[str]:
    peak = found.get("peak_bf16_tflops")
    lines = [
        f"TFLOP/s, median [range] over {found.get('rounds')} rounds; the bf16 peak: "
        + (f"{peak:g} TFLOP/s ({found['peak_source']})." if peak else "unknown for this device.")
        + " Hopper's FP8 tensor-core peak is twice its bf16 peak.",
        "",
        "| m x k x n | bf16 TFLOP/s | of peak | fp8 TFLOP/s | fp8 / bf16 | FP8 GEMM | "
        "fp8 rel. error |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in found.get("shapes", []):
        shape = f"{entry['m']} x {entry['k']} x {entry['n']}"
        if "error" in entry:
            lines.append(f"| {shape} | {entry['error'].splitlines()[0][:120]} ||||||")
            continue
        of_peak = f"{entry['bf16_of_peak']:.0%}" if "bf16_of_peak" in entry else "-"
        fp8 = {True: "yes", False: "no", None: "-"}[entry.get("fp8_gemm")]
        error = entry.get("fp8_max_rel_error")
        lines.append(
            f"| {shape} | {ratio_text(entry.get('bf16_tflops'))} | {of_peak} | "
            f"{ratio_text(entry.get('fp8_tflops'))} | {ratio_text(entry.get('fp8_over_bf16'))} | "
            f"{fp8} | {'-' if error is None else f'{error:.3f}'} |"
        )
    errors = [
        (e, k) for e in found.get("shapes", []) for k in ("bf16_error", "fp8_error") if k in e
    ]
    lines += [f"- {e['m']}x{e['k']}x{e['n']} {k}: `{e[k].splitlines()[0]}`" for e, k in errors]
    return [*lines, ""]
