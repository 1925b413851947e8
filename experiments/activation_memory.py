"""What keeping an activation's input alone saves (jaxmoe/layers/activations.py): XLA:CPU's
compiled memory of a stack of SwiGLU layers, and the planner's estimates of the seeds'
models at a few layouts, with the activations as written and keeping their input.

    python -m experiments.activation_memory [--out experiments/results/activation_memory.md]

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

from experiments.folding_models import planned_config
from experiments.shared.results_file import command_line
from jaxmoe.layers import activations

RESULTS = Path(__file__).parent / "results" / "activation_memory.md"
PROFILE = "h100-8x-nvlink-3200g"
# (layers, tokens, width, hidden) of the compiled stacks.
STACKS = [(8, 2048, 256, 1024), (4, 4096, 512, 2048)]
# The planner's layouts: (tensor, expert, expert tensor, dispatcher), the schedules as
# experiments/scale_eval.py searches them, one sequence of 4096 tokens per device.
SEARCHES = {
    ("qwen2-57b-a14b", 64): [(1, 32, 1, "all_to_all"), (1, 64, 1, "all_to_all")],
    ("mixtral-8x22b", 64): [(1, 8, 8, "all_to_all"), (8, 8, 1, "all_to_all")],
}
SCHEDULES = ("none", "dw", "lancet", "pair")
FORMS = ("as written", "input kept")


@contextlib.contextmanager
def activations_as(form: str) -> Iterator[None]:
    """The activations of every block whose forward values are kept, in ``form``."""
    if form == "input kept":
        yield
        return
    with mock.patch.dict(activations._INPUT_KEPT, activations._AS_WRITTEN):
        yield


def stack_temporaries(layers: int, tokens: int, width: int, hidden: int) -> int:
    """XLA:CPU's compiled temporaries of the gradient of ``layers`` residual SwiGLU layers."""
    weights = [(jnp.zeros((width, 2, hidden)), jnp.zeros((hidden, width)))] * layers

    def loss(weights, x):
        for w_in, w_out in weights:
            gate_up = jnp.einsum("td,dkh->tkh", x, w_in)
            x = x + activations.activate("swiglu", gate_up, "none") @ w_out
        return (x**2).sum()

    compiled = jax.jit(jax.grad(loss)).lower(weights, jnp.zeros((tokens, width))).compile()
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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    lines = [
        "# Keeping an activation's input alone for the backward pass",
        "",
        f"Command: `{command_line('experiments.activation_memory', argv)}`",
        "",
        "## XLA:CPU's compiled memory",
        "",
        "The gradient of a stack of residual SwiGLU layers (`x + swiglu(x W_in) W_out`, "
        "float32), compiled for the CPU: its temporaries (`memory_analysis()`).",
        "",
        "| layers | tokens | width | hidden | as written MB | input kept MB | kept / written |",
        "|---|---|---|---|---|---|---|",
    ]
    for stack in STACKS:
        sizes = {}
        for form in FORMS:
            with activations_as(form):
                sizes[form] = stack_temporaries(*stack)
        written, kept = sizes["as written"], sizes["input kept"]
        lines.append(
            "| {} | {} | {} | {} | ".format(*stack)
            + f"{written / 1e6:.1f} | {kept / 1e6:.1f} | {kept / written:.2f} |"
        )
    lines += [
        "",
        "## The planner's estimates",
        "",
        f"Profile `{PROFILE}`, one sequence of 4096 tokens per device, the schedules "
        f"{', '.join(f'`{s}`' for s in SCHEDULES)} (the fastest counts), every ZeRO stage, "
        "recomputation and number of microbatches of the layouts named; no pipeline. A "
        "recomputed block (`layer`, `matmuls`) runs the activation as written either way.",
        "",
        "| model | devices | activations | mapping | schedule | MFU | GB/device | fits 80 GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (model, devices), layouts in SEARCHES.items():
        for form in FORMS:
            started = time.perf_counter()
            with activations_as(form):
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
