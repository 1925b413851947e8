"""Parallel folding, evaluated: every layout of the ``small`` preset on 8 CPU devices
trains as the unfolded layout does.

(a) Each valid mapping of the ``small`` preset onto 8 devices
    (:func:`jaxmoe.plan.mappings.enumerate_mappings`: attention data x tensor, MoE
    expert data x expert x expert tensor, both dispatchers) trains a few steps from
    the same seed on the same batches as the reference layout (attention 8x1, MoE
    1x8x1, all_to_all). ``moe.group_size`` is fixed to one that divides seq_len /
    tensor for every layout, so routing groups hold the same tokens everywhere and
    the same assignments must be dropped. Per layout: the largest relative loss
    difference to the reference at each step, whether the dropped fraction is equal
    at every step, and the peak memory per device from XLA's memory analysis of the
    compiled step. Each layout is compiled once and its executable runs every step.
    Layouts run in a fixed order (the reference first, then round-robin over the
    tensor sizes, so a partial run covers every attention layout); the results file
    says which ran.
(b) The planner's comparison on published model shapes at 64-256 devices is
    ``experiments.folding_scale`` (results in ``folding_scale.md``).

    python -m experiments.folding_eval [--steps 3] [--limit K] [--skip K] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.shared.results_file import command_line
from jaxmoe.train.resolved import resolve

RESULTS = Path(__file__).parent / "results"
DEVICES = 8
STEPS = 3
# Tokens per routing group: divides seq_len / tensor (128 / 4) for every valid layout.
GROUP_SIZE = 32
REFERENCE = "attention 8x1, MoE 1x8x1, all_to_all"
# Losses of two layouts differ only in the order of float32 sums (partial sums over
# other devices, hidden slices reduced by collectives): single ulps (1.2e-7) of each
# value. AdamW amplifies round-off where a gradient element cancels (its update is
# ~lr * g / |g|), so after a few steps losses may drift by more than ulps; 1e-5 (the
# issue's acceptance bound for 5 steps) leaves that room and still catches any real
# error (a wrong reduction axis or a different drop moves the loss by 1e-3 or more).
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes per device of the compiled step, from ``compiled.memory_analysis()``."""

    argument: int  # argument_size_in_bytes: the state shards and the batch
    output: int  # output_size_in_bytes: the new state and the metrics
    temp: int  # temp_size_in_bytes: XLA's working buffers
    alias: int  # alias_size_in_bytes: outputs written into donated arguments

    @property
    def peak(self) -> int:
        """argument + output + temp (an upper bound: aliased outputs counted twice)."""
        return self.argument + self.output + self.temp


@dataclass(frozen=True)
class LayoutRun:
    label: str
    losses: tuple[float, ...]
    dropped: tuple[float, ...]
    memory: DeviceMemory
    seconds: float  # compile and every step


@dataclass(frozen=True)
class Comparison:
    label: str
    losses: tuple[float, ...]
    dropped: tuple[float, ...]
    relative_loss_diff: tuple[float, ...]  # per step, |loss - reference| / |reference|
    dropped_equal: bool
    memory: DeviceMemory

    @property
    def max_relative_loss_diff(self) -> float:
        return max(self.relative_loss_diff)

    @property
    def within_tolerance(self) -> bool:
        return self.max_relative_loss_diff <= LOSS_RTOL and self.dropped_equal


def compare(reference: LayoutRun, run: LayoutRun) -> Comparison:
    """``run`` against ``reference`` step by step (both must have run the same steps)."""
    if len(run.losses) != len(reference.losses):
        raise ValueError(
            f"{run.label}: {len(run.losses)} steps, the reference ran {len(reference.losses)}"
        )
    ref = np.asarray(reference.losses, dtype=np.float64)
    diff = np.abs(np.asarray(run.losses, dtype=np.float64) - ref) / np.abs(ref)
    return Comparison(
        run.label,
        run.losses,
        run.dropped,
        tuple(float(d) for d in diff),
        run.dropped == reference.dropped,
        run.memory,
    )


def eval_config(preset_name: str = "small", group_size: int = GROUP_SIZE, steps: int = STEPS):
    """The preset with a fixed routing group size and ``steps`` steps."""
    from jaxmoe.presets import preset

    config = preset(preset_name)
    return dataclasses.replace(
        config,
        moe=dataclasses.replace(config.moe, group_size=group_size),
        train=dataclasses.replace(config.train, steps=steps),
    )


def ordered_layouts(config, devices: int = DEVICES, reference: str = REFERENCE) -> list:
    """The valid mappings (``Candidate``s): the reference first, then round-robin over
    the attention tensor sizes, each in enumeration order."""
    from jaxmoe.plan.mappings import enumerate_mappings

    valid = enumerate_mappings(config, devices).valid
    labels = [c.mapping.label() for c in valid]
    if reference not in labels:
        raise ValueError(f"the reference layout {reference!r} is not valid for this config")
    by_tensor: dict[int, list] = {}
    for candidate in valid:
        if candidate.mapping.label() != reference:
            by_tensor.setdefault(candidate.mapping.tensor, []).append(candidate)
    ordered = [valid[labels.index(reference)]]
    queues = [by_tensor[t] for t in sorted(by_tensor)]
    while any(queues):
        ordered += [queue.pop(0) for queue in queues if queue]
    return ordered


def batches(config, steps: int, seed: int = 0) -> list[np.ndarray]:
    """``steps`` batches of random byte tokens, ``[batch, seq_len + 1]`` each."""
    rng = np.random.default_rng(seed)
    shape = (config.train.batch_size, config.model.seq_len + 1)
    return [rng.integers(0, 256, shape).astype(np.int32) for _ in range(steps)]


def run_layout(label: str, config, host_batches: Sequence[np.ndarray]) -> LayoutRun:
    """Compile ``config``'s step once, read its memory analysis, run every batch."""
    import jax
    from jax.sharding import NamedSharding

    from jaxmoe.parallel.mesh import build_mesh, token_spec
    from jaxmoe.train.state import init_train_state
    from jaxmoe.train.step import build_train_step

    start = time.perf_counter()
    mesh = build_mesh(config.parallel)
    placed = [jax.device_put(b, NamedSharding(mesh, token_spec(mesh))) for b in host_batches]
    state = init_train_state(resolve(config, mesh))
    compiled = build_train_step(resolve(config, mesh)).jit().lower(state, placed[0]).compile()
    analysis = compiled.memory_analysis()
    memory = DeviceMemory(
        analysis.argument_size_in_bytes,
        analysis.output_size_in_bytes,
        analysis.temp_size_in_bytes,
        analysis.alias_size_in_bytes,
    )
    losses, dropped = [], []
    for batch in placed:
        state, metrics = compiled(state, batch)
        metrics = jax.device_get(metrics)
        losses.append(float(metrics["loss"]))
        dropped.append(float(metrics["dropped_fraction"]))
    del state, compiled
    jax.clear_caches()
    return LayoutRun(label, tuple(losses), tuple(dropped), memory, time.perf_counter() - start)


def evaluate(
    config, candidates: Sequence, steps: int, on_result: Callable[[list[Comparison]], None]
) -> list[Comparison]:
    """Run the candidates in order (the first is the reference), comparing each with it;
    ``on_result`` gets the comparisons so far after every layout."""
    host_batches = batches(config, steps)
    reference, comparisons = None, []
    for candidate in candidates:
        run = run_layout(candidate.mapping.label(), candidate.config, host_batches)
        reference = reference or run
        comparisons.append(compare(reference, run))
        print(f"{run.label}: {run.seconds:.1f} s, losses {run.losses}", flush=True)
        on_result(comparisons)
    return comparisons


def table(comparisons: Sequence[Comparison]) -> list[str]:
    mib = 2**20
    lines = [
        "| layout | max rel. loss diff | per step | dropped equal | peak MiB/device "
        "| argument | output | temp | alias |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        m = c.memory
        per_step = ", ".join(f"{d:.1e}" for d in c.relative_loss_diff)
        lines.append(
            f"| {c.label} | {c.max_relative_loss_diff:.1e} | {per_step} | "
            f"{'yes' if c.dropped_equal else 'NO'} | {m.peak / mib:.2f} | "
            f"{m.argument / mib:.2f} | {m.output / mib:.2f} | {m.temp / mib:.2f} | "
            f"{m.alias / mib:.2f} |"
        )
    return lines


def report(comparisons: Sequence[Comparison], total: int, steps: int, command: str) -> str:
    """The results file; the first comparison is the reference's own."""
    passed = sum(c.within_tolerance for c in comparisons)
    worst = max(comparisons, key=lambda c: c.max_relative_loss_diff)
    lines = [
        "# Parallel folding: every layout of `small` on 8 CPU devices",
        "",
        f"    {command}",
        "",
        f"Preset `small` with `moe.group_size={GROUP_SIZE}` (divides seq_len / tensor for "
        f"every layout), {steps} steps from seed 0 on the same random byte batches; each "
        f"layout compiled once. Reference: {comparisons[0].label} (losses "
        f"{', '.join(f'{x:.6f}' for x in comparisons[0].losses)}; dropped fraction "
        f"{', '.join(f'{x:.4f}' for x in comparisons[0].dropped)}).",
        "",
        f"Ran {len(comparisons)} of the {total} valid layouts"
        + ("." if len(comparisons) == total else " (in the order below; the rest did not run)."),
        f"Within tolerance (relative loss difference <= {LOSS_RTOL:g} at every step, dropped "
        f"fraction equal at every step): {passed} of {len(comparisons)}. Largest difference: "
        f"{worst.max_relative_loss_diff:.1e} ({worst.label}).",
        "",
        f"Tolerance {LOSS_RTOL:g}: the layouts differ only in the order of float32 sums, "
        "ulps (1.2e-7) per value, which AdamW can amplify where a gradient element "
        "cancels; a wrong reduction axis or a different drop moves the loss by far more.",
        "",
        "Memory per device: XLA's memory analysis of the compiled step; peak = argument + "
        "output + temp bytes (an upper bound: the state is donated, so outputs aliased to "
        "arguments, the `alias` column, are counted twice). CPU backend figures.",
        "",
        *table(comparisons),
        "",
        "Part (b), the planner on Mixtral- and Qwen2-shaped models at 64-256 H100s: "
        "`folding_scale.md`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--limit", type=int, default=0, help="run only the first K layouts")
    parser.add_argument(
        "--skip", type=int, default=0, help="leave out the K layouts after the reference"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "folding_eval.md")
    args = parser.parse_args(argv)
    from jaxmoe.parallel.host_devices import ensure_host_devices

    ensure_host_devices(DEVICES)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    command = command_line("experiments.folding_eval", sys.argv[1:] if argv is None else argv)
    config = eval_config(steps=args.steps)
    candidates = ordered_layouts(config)
    chosen = candidates[:1] + candidates[1 + args.skip :]
    chosen = chosen[: args.limit] if args.limit else chosen

    def write(comparisons: list[Comparison]) -> None:
        args.out.write_text(report(comparisons, len(candidates), args.steps, command))

    evaluate(config, chosen, args.steps, write)


if __name__ == "__main__":
    main()
