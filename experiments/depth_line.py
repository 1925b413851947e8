"""How close the planner's depth line comes to deeper traces of the seed models' planned
mappings: each mapping's step traced with one to five blocks, and the line through one and
two blocks and through two and three (the planner's, :mod:`jaxmoe.plan.layer_extrapolation`)
against the four- and five-block traces.

    python -m experiments.depth_line [--out experiments/results/depth_line.md] [--blocks 5]
        [--case NAME ...] [--schedules none,dw,lancet,pair] [--no-packing]

A line is exact where every block between the first and the last adds the same to the
step; the table says what each block adds, and each line's error where a trace can check
it. The cases are mappings ``experiments.scale_eval`` found best, and Qwen2-57B-A14B's
MoE 8x8x1 at its recipe (the runner-up there, whose blocks once added unlike amounts),
each under every schedule the planner weighs, on the H100 profile. Then, for
each mapping, ``dw``'s two packings of dW work (its last candidates forced into a window
or not) with and without the schedule's live-bytes bound, and nothing placed: where a
mapping's blocks add unlike amounts, these say why. Simulated steps, not timings: the
same on every run.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from experiments.shared.results_file import command_line, source_tree

RESULTS = Path(__file__).parent / "results" / "depth_line.md"
PROFILE = "h100-8x-nvlink-3200g"
SCHEDULES = ("none", "dw", "lancet", "pair")


@dataclass(frozen=True)
class Case:
    label: str
    model: str
    devices: int
    batch: int  # sequences a step
    mapping: dict  # jaxmoe.plan.mappings.Mapping's fields but the devices

    @property
    def name(self) -> str:
        return f"{self.model} {self.label}"


CASES = (
    Case(
        "at its recipe",
        "qwen2-57b-a14b",
        64,
        256,
        dict(expert_data=4, expert=16, zero=3, recompute="layer"),
    ),
    Case(
        "at its recipe",
        "qwen2-57b-a14b",
        64,
        256,
        dict(expert_data=8, expert=8, zero=3, recompute="layer"),
    ),
    Case(
        "at its recipe, paired",
        "qwen2-57b-a14b",
        64,
        256,
        dict(tensor=4, expert_data=2, expert=32, recompute="none", microbatches=16),
    ),
    Case("on 64 H100s", "qwen2-57b-a14b", 64, 64, dict(expert=64, zero=3, recompute="none")),
    Case(
        "at its recipe",
        "mixtral-8x22b",
        128,
        256,
        dict(expert_data=2, expert=8, expert_tensor=8, recompute="layer", microbatches=2),
    ),
    Case(
        "at its recipe, pipelined",
        "mixtral-8x22b",
        128,
        256,
        dict(
            tensor=4,
            expert=8,
            expert_tensor=8,
            pipeline=2,
            recompute="matmuls",
            microbatches=16,
        ),
    ),
    Case(
        "at its recipe, four stages",
        "mixtral-8x22b",
        128,
        256,
        dict(
            tensor=4,
            expert=8,
            expert_tensor=4,
            pipeline=4,
            virtual_stages=2,
            recompute="none",
            microbatches=32,
        ),
    ),
    Case(
        "on 64 H100s",
        "mixtral-8x22b",
        64,
        64,
        dict(expert=8, expert_tensor=8, recompute="layer"),
    ),
    Case(
        "on 128 H100s",
        "mixtral-8x22b",
        128,
        128,
        dict(expert_data=4, expert=8, expert_tensor=4, recompute="layer"),
    ),
    Case(
        "on 256 H100s",
        "qwen2-57b-a14b",
        256,
        256,
        dict(expert_data=4, expert=64, recompute="none"),
    ),
)


def _config(case: Case):
    from experiments.folding_models import planned_config
    from jaxmoe.plan.mappings import Mapping, with_mapping

    fields = dict(tensor=1, expert_data=1, expert_tensor=1, dispatcher="all_to_all", zero=1)
    mapping = Mapping(devices=case.devices, **(fields | case.mapping))
    return with_mapping(planned_config(case.model, case.devices, case.batch), mapping, 8)


def traced_steps(
    case: Case, most_blocks: int, schedules: Sequence[str] = SCHEDULES
) -> tuple[int, dict[str, list[float]], dict[str, tuple[int, int]]]:
    """The model's block count, each of ``schedules``' simulated step (seconds) with 1
    to ``most_blocks`` blocks, and the two depths the planner's line runs through for each
    (:func:`~jaxmoe.plan.layer_extrapolation.line_depths`)."""
    from jaxmoe.plan.estimates import EstimateCache
    from jaxmoe.plan.layer_extrapolation import block_count, line_depths, with_blocks
    from jaxmoe.plan.tracer import Tracer

    config = _config(case)
    tracer = Tracer(schedules, PROFILE, EstimateCache(None))
    steps: dict[str, list[float]] = {}
    for blocks in range(1, most_blocks + 1):
        _, times = tracer.estimate(with_blocks(config, blocks))
        for schedule, time in times.items():
            steps.setdefault(schedule, []).append(time.step)
    found = block_count(config)
    assert found is not None
    lines = {
        schedule: line_depths(
            schedule,
            lambda depth, s=schedule: tracer.bound_withdrew(with_blocks(config, depth), s),
            found,
            lambda depth: tracer.ops(with_blocks(config, depth)),
        )
        for schedule in steps
    }
    return found, steps, lines


# dW packing's two ways (its last candidates forced into a window or not) under the
# schedule's live-bytes bound and with none: what ``dw`` chooses between; and nothing placed
# (None), collectives started early and waited for late alone.
PACKINGS = ((True, 0.1), (True, math.inf), (False, 0.1), (False, math.inf), (None, math.inf))


def packing_steps(case: Case, most_blocks: int) -> dict[tuple, list[tuple]]:
    """Under ``dw``, with 1 to ``most_blocks`` blocks, for each of :data:`PACKINGS`: the
    simulated step (seconds), and the peak of live bytes of the order with every placement
    kept, over the program's own peak (the list scheduler's count: no fusion)."""
    import dataclasses

    from jaxmoe.plan.layer_extrapolation import with_blocks
    from jaxmoe.plan.tracer import trace, with_schedule
    from jaxmoe.train.resolved import schedule_policy
    from scheduling import ExperimentalOptions, cost_model, schedule

    found: dict[tuple, list[tuple]] = {packing: [] for packing in PACKINGS}
    for blocks in range(1, most_blocks + 1):
        config = with_schedule(with_blocks(_config(case), blocks), "dw", PROFILE)
        program = trace(config).program
        policy = schedule_policy(config)
        cost = cost_model(policy, program.mesh, program).priced_once()
        for force, growth in PACKINGS:
            packing = ExperimentalOptions(force_dw=force)
            name = "async" if force is None else "dw"  # async: nothing placed
            bounded = dataclasses.replace(policy, name=name, max_live_bytes_growth=growth)
            unbounded = dataclasses.replace(bounded, max_live_bytes_growth=math.inf)
            scheduled = schedule(program, bounded, cost, (), packing)
            kept = schedule(program, unbounded, cost, (), packing).order
            step = scheduled.timeline.step_seconds
            peak = kept.peak_live_bytes / kept.baseline_peak_live_bytes
            found[force, growth].append((step, peak))
    return found


def line(steps: Sequence[float], first: int, blocks: int, second: int | None = None) -> float:
    """The step of ``blocks`` blocks on the line through the traces of ``first`` and
    ``second`` blocks (by default ``first + 1``; ``steps[k]``: the trace of ``k + 1``
    blocks)."""
    second = first + 1 if second is None else second
    low, high = steps[first - 1], steps[second - 1]
    return low + (blocks - first) * (high - low) / (second - first)


Row = tuple[Case, int, dict[str, list[float]], dict[str, tuple[int, int]]]


def render(rows: list[Row], argv: Sequence[str]) -> str:
    text = [
        "# The depth line against deeper traces",
        "",
        f"`{command_line('experiments.depth_line', argv)}` at {source_tree()}. "
        "Simulated steps on the H100 profile (`h100-8x-nvlink-3200g`), in ms; the same on "
        "every run.",
        "",
        "Each mapping's step traced with one block and more. *Adds*: what each block "
        "adds to the step, the second, the third and so on. *1-2* and *2-3*: the line "
        "through one and two blocks, and through two and three; *planner's*: the line "
        "the planner draws (jaxmoe/plan/layer_extrapolation.py: two and three blocks, "
        "deeper where its live-bytes bound withdrew at one of them only, and two and "
        "eight for a paired schedule), at the deepest trace (its error beside each) and "
        "at the model's depth.",
        "",
    ]
    for case, depth, steps, depths in rows:
        fields = ", ".join(f"{k} {v}" for k, v in case.mapping.items())
        deepest = len(next(iter(steps.values())))
        text += [
            f"## {case.model} {case.label} ({case.devices} devices, {case.batch} sequences, "
            f"{fields}; {depth} blocks)",
            "",
            f"| schedule | traced steps, 1 to {deepest} blocks | adds | 1-2 at {deepest} | "
            f"2-3 at {deepest} | planner's at {deepest} | 1-2 at {depth} | 2-3 at {depth} "
            f"| planner's at {depth} |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for schedule, found in steps.items():
            adds = [b - a for a, b in itertools.pairwise(found)]
            first, second = depths[schedule]
            planned = f"{first}-{second}"
            at_deepest = [line(found, 1, deepest), line(found, 2, deepest)]
            if second <= deepest:
                at_deepest.append(line(found, first, deepest, second))
            text.append(
                f"| `{schedule}` | {', '.join(f'{s * 1e3:.1f}' for s in found)} "
                f"| {', '.join(f'{a * 1e3:.2f}' for a in adds)} "
                + "".join(f"| {s * 1e3:.1f} ({s / found[-1] - 1:+.2%}) " for s in at_deepest)
                + ("" if second <= deepest else f"| {planned}: not traced ")
                + f"| {line(found, 1, depth) * 1e3:.0f} | {line(found, 2, depth) * 1e3:.0f} "
                + (
                    f"| {planned}: {line(found, first, depth, second) * 1e3:.0f} |"
                    if second <= deepest
                    else "| |"
                )
            )
        text.append("")
    return "\n".join(text)


NAMES = {True: "forced", False: "unforced", None: "nothing placed"}


def render_packing(case: Case, found: dict[tuple, list[tuple]]) -> str:
    """Why a mapping's blocks add unlike amounts: ``dw``'s packings, each depth's step and
    what each block adds, and the placements' peak of live bytes."""
    fields = ", ".join(f"{k} {v}" for k, v in case.mapping.items())
    lines = [
        f"## dW packing at depth: {case.model} {case.label} ({fields}), `dw`",
        "",
        "The two packings `dw` chooses between (the shorter step of the two is kept where "
        "the forced work overfills a window), under the schedule's live-bytes bound (10% "
        "over the program's own peak; placements withdrawn largest outputs first) and "
        "with none; and nothing placed (collectives started early and waited for late). "
        "*Peak*: the live bytes of the order with every placement kept, over the "
        "program's own peak (the list scheduler's count, without fusion).",
        "",
        "| packing | bound | traced steps, ms | adds, ms | peak |",
        "|---|---|---|---|---|",
    ]
    for (force, growth), rows in found.items():
        steps = [step for step, _ in rows]
        adds = [b - a for a, b in itertools.pairwise(steps)]
        lines.append(
            f"| {NAMES[force]} | "
            f"{'none' if math.isinf(growth) else f'{growth:.0%}'} "
            f"| {', '.join(f'{s * 1e3:.1f}' for s in steps)} "
            f"| {', '.join(f'{a * 1e3:.2f}' for a in adds)} "
            f"| {', '.join(f'{g:.2f}x' for _, g in rows)} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--blocks", type=int, default=5, help="the deepest trace (at least 4)")
    parser.add_argument(
        "--case",
        action="append",
        choices=[case.name for case in CASES],
        help="only this case (repeatable; default: every case)",
    )
    parser.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        help="the schedules traced, comma-separated (default: all the planner weighs)",
    )
    parser.add_argument(
        "--no-packing", action="store_true", help="leave out the dW packings at depth"
    )
    args = parser.parse_args(argv)
    if args.blocks < 4:
        parser.error(f"--blocks={args.blocks}: at least 4, to check the line through 2 and 3")
    schedules = [s for s in args.schedules.split(",") if s]
    if not schedules or any(s not in SCHEDULES for s in schedules):
        parser.error(f"--schedules {args.schedules!r}: choose from {', '.join(SCHEDULES)}")
    cases = [case for case in CASES if args.case is None or case.name in args.case]
    rows = []
    for case in cases:
        rows.append((case, *traced_steps(case, args.blocks, schedules)))
        print(f"{case.model} {case.label}: traced", flush=True)
    packing = (
        []
        if args.no_packing
        else [render_packing(case, packing_steps(case, args.blocks)) for case in cases]
    )
    args.out.write_text("\n".join([render(rows, argv), *packing]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
