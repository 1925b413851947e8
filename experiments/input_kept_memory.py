"""What keeping an activation's or a norm's input alone saves (jaxmoe/layers/input_kept.py):
XLA:CPU's compiled memory of stacks of SwiGLU layers and of normed layers, and the
planner's estimates of the seeds' models at a few layouts, with the activations and the
norms as written, the activations keeping their inputs, and both keeping their inputs.

    python -m experiments.input_kept_memory [--out experiments/results/input_kept_memory.md]

Both are memory and estimates, not timings: the same on every run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.folding_models import planned_config
from experiments.shared.results_file import command_line
from jaxmoe.config import ModelConfig
from jaxmoe.layers import activations, norms
from jaxmoe.train import state

RESULTS = Path(__file__).parent / "results" / "input_kept_memory.md"
PROFILE = "h100-8x-nvlink-3200g"
# (layers, tokens, width, hidden) of the compiled SwiGLU stacks (float32), and (layers,
# tokens, width) of the normed ones (bfloat16, as the seeds' models compute).
SWIGLU_STACKS = [(8, 2048, 256, 1024), (4, 4096, 512, 2048)]
NORM_STACKS = [(8, 4096, 256), (4, 8192, 512)]
# The planner's layouts: (tensor, expert, expert tensor, dispatcher), the schedules as
# experiments/scale_eval.py searches them, one sequence of 4096 tokens per device.
SEARCHES = {
    ("qwen2-57b-a14b", 64): [(1, 32, 1, "all_to_all"), (1, 64, 1, "all_to_all")],
    ("mixtral-8x22b", 64): [(1, 8, 8, "all_to_all"), (8, 8, 1, "all_to_all")],
}
SCHEDULES = ("none", "dw", "lancet", "pair")
# What keeps its input alone, in each form.
FORMS = {
    "as written": (),
    "activations": ("activations",),
    "activations and norms": ("activations", "norms"),
}


@contextlib.contextmanager
def kept_as(form: str) -> Iterator[None]:
    """The activations and norms of every block whose forward values are kept, keeping
    their inputs alone as ``form`` says (the others as written)."""
    kept = FORMS[form]
    # A model's structure, its norms' classes among it, is built once per model: afresh
    # in each form.
    for cached in (state.abstract_model, state.gather_dtypes):
        cached.cache_clear()
    try:
        with contextlib.ExitStack() as stack:
            for name, module in (("activations", activations), ("norms", norms)):
                if name not in kept:
                    patched = mock.patch.object(module, "kept_inputs", lambda _: False)
                    stack.enter_context(patched)
            yield
    finally:
        for cached in (state.abstract_model, state.gather_dtypes):
            cached.cache_clear()


def swiglu_temporaries(layers: int, tokens: int, width: int, hidden: int) -> int:
    """XLA:CPU's compiled temporaries of the gradient of ``layers`` residual SwiGLU layers."""
    weights = [(jnp.zeros((width, 2, hidden)), jnp.zeros((hidden, width)))] * layers

    def loss(weights, x):
        for w_in, w_out in weights:
            gate_up = jnp.einsum("td,dkh->tkh", x, w_in)
            x = x + activations.activate("swiglu", gate_up, "none") @ w_out
        return (x**2).sum()

    compiled = jax.jit(jax.grad(loss)).lower(weights, jnp.zeros((tokens, width))).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def norm_temporaries(layers: int, tokens: int, width: int) -> int:
    """XLA:CPU's compiled temporaries of the gradient of ``layers`` residual layers
    ``x + rmsnorm(x) W`` in bfloat16, each with its own norm (:func:`norms.make_norm`)."""
    model = ModelConfig(norm="rmsnorm")
    made = [
        norms.make_norm(model, width, dtype=jnp.bfloat16, rngs=nnx.Rngs(i)) for i in range(layers)
    ]
    graphdef, state = nnx.split(made)
    weight = jnp.zeros((width, width), jnp.bfloat16)

    def loss(state, x):
        for norm in nnx.merge(graphdef, state):
            x = x + norm(x) @ weight
        return x.astype(jnp.float32).sum()

    x = jnp.zeros((tokens, width), jnp.bfloat16)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def planned(model: str, devices: int, layouts: list[tuple]) -> tuple[list[dict], float]:
    """Every estimate the planner makes on ``layouts`` (no pipeline), best first, and the
    least memory bound (GB) of those without recomputation it left out by it."""
    from jaxmoe.plan.planner import plan_mappings

    result = plan_mappings(
        planned_config(model, devices),
        model,
        devices,
        PROFILE,
        SCHEDULES,
        top=3,
        pipeline=False,
        layouts=lambda m: (
            (m.tensor, m.expert, m.expert_tensor, m.dispatcher) in layouts and m.context == 1
        ),
    )
    estimates = [
        {
            "mapping": e.mapping.label(),
            "schedule": e.schedule,
            "mfu": e.mfu,
            "gb": e.peak_bytes / 1e9,
            "fits": e.fits,
        }
        for e in result.estimates
    ]
    # The mappings left out by their memory bound that keep their blocks' forward values.
    bounds = [
        n.memory_bound
        for n in result.not_estimated
        if n.kind == "memory" and n.mapping.recompute == "none" and n.memory_bound
    ]
    return estimates, min(bounds, default=0) / 1e9


def _compiled_rows(stacks: list[tuple], temporaries) -> list[str]:
    rows = []
    for stack in stacks:
        sizes = {}
        for form in FORMS:
            with kept_as(form):
                sizes[form] = temporaries(*stack)
        written = sizes["as written"]
        cells = " | ".join(f"{size / 1e6:.1f} ({size / written:.2f})" for size in sizes.values())
        rows.append(f"| {' | '.join(map(str, stack))} | {cells} |")
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    forms = " | ".join(f"{form} MB" for form in FORMS)
    lines = [
        "# Keeping an activation's or a norm's input alone for the backward pass",
        "",
        f"Command: `{command_line('experiments.input_kept_memory', argv)}`",
        "",
        "## XLA:CPU's compiled memory",
        "",
        "The gradients of stacks of layers compiled for the CPU: their temporaries "
        "(`memory_analysis()`), with what keeps its input alone (the ratio to as written "
        "beside each).",
        "",
        "Residual SwiGLU layers, `x + swiglu(x W_in) W_out`, float32 (the activations'):",
        "",
        f"| layers | tokens | width | hidden | {forms} |",
        "|---|---|---|---|---|---|---|",
        *_compiled_rows(SWIGLU_STACKS, swiglu_temporaries),
        "",
        "Residual normed layers, `x + rmsnorm(x) W`, bfloat16 (the norms' float32 copies):",
        "",
        f"| layers | tokens | width | {forms} |",
        "|---|---|---|---|---|---|",
        *_compiled_rows(NORM_STACKS, norm_temporaries),
        "",
        "## The planner's estimates",
        "",
        f"Profile `{PROFILE}`, one sequence of 4096 tokens per device, the schedules "
        f"{', '.join(f'`{s}`' for s in SCHEDULES)} (the fastest counts), every ZeRO stage, "
        "recomputation and number of microbatches of the layouts named; no pipeline. A "
        "recomputed block (`layer`, `matmuls`) runs its activations and norms as written "
        "in every form. Shown: each estimate without recomputation, and the best that fits.",
        "",
        "| model | devices | inputs kept by | mapping | schedule | MFU | GB/device | fits 80 GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (model, devices), layouts in SEARCHES.items():
        for form in FORMS:
            started = time.perf_counter()
            with kept_as(form):
                found, least = planned(model, devices, layouts)
            print(f"{model} {form}: {time.perf_counter() - started:.0f} s", flush=True)
            shown = [e for e in found if "recompute layer" not in e["mapping"]] + [
                e for e in found if e["fits"]
            ][:1]
            for e in shown:
                lines.append(
                    f"| {model} | {devices} | {form} | {e['mapping']} | `{e['schedule']}` | "
                    f"{e['mfu']:.1%} | {e['gb']:.1f} | {'yes' if e['fits'] else 'no'} |"
                )
            if least:
                lines.append(
                    f"| {model} | {devices} | {form} | the others without recomputation: not "
                    f"estimated, {least:.0f} GB or more | | | | no |"
                )
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
