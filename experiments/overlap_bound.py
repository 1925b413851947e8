"""How far each ordering schedule's simulated step is from what no order of the traced
step can beat: the seed models' recipe mappings traced at a few blocks, under the
schedules that order the step's graph as traced and rewrite none of it (``none``, ``dw``,
``pair``), against the graph's dependency bound.

    python -m experiments.overlap_bound [--out experiments/results/overlap_bound.md]
        [--case NAME ...] [--blocks 2,3]

The bound. The simulator (:mod:`scheduling.costs.simulate`) runs compute ops one at a time
on one stream and collectives one at a time on the link, none before its operands are
ready. So the compute ops a collective depends on all run before it begins, and those
that depend on it all run after it ends; along a chain of collectives, each depending on
the one before, the compute ops between two of them (depending on the first, needed by
the second) run between the first's end and the second's start. The step is no shorter
than the longest such chain (the compute before its first collective, each collective's
link seconds and the compute between it and the next, the compute after its last), nor
than all its compute or all its link work. No order of the graph does better, whatever
its priorities; a schedule that partitions exchanges (``lancet``) or decomposes them
(``comet``) rewrites the graph, and is not bounded by it.

Where a schedule's step is over the bound, its exposed communication says why, in two
parts: stalls while the link was still carrying other collectives (the link behind), and
the rest, stalls of collectives the link took at once but whose windows held too little
compute. Simulated steps on the H100 profile, the same on every run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.depth_line import CASES, Case, _config
from experiments.shared.results_file import command_line, source_tree

RESULTS = Path(__file__).parent / "results" / "overlap_bound.md"
PROFILE = "h100-8x-nvlink-3200g"
SCHEDULES = ("none", "dw", "pair")
DEFAULT_CASES = ("mixtral-8x22b at its recipe, pipelined", "qwen2-57b-a14b at its recipe, paired")


def dependency_bound(
    ancestors: Sequence[int],
    descendants: Sequence[int],
    seconds: Sequence[float],
    collective: Sequence[bool],
) -> float:
    """The least step of a graph whose nodes, in a topological order, have these
    ``ancestors`` and ``descendants`` (bit sets, as :class:`scheduling.Graph` keeps them),
    ``seconds`` each, the ``collective`` ones on the link and the rest on the compute
    stream (module docstring)."""
    count = len(seconds)
    cost = np.asarray(seconds, dtype=np.float64)
    on_link = np.asarray(collective, dtype=bool)
    compute = np.where(on_link, 0.0, cost)
    links = np.flatnonzero(on_link)
    if not len(links):
        return float(compute.sum())

    def members(mask: int) -> np.ndarray:
        packed = np.frombuffer(mask.to_bytes((count + 7) // 8, "little"), dtype=np.uint8)
        return np.unpackbits(packed, bitorder="little")[:count].astype(bool)

    before = np.stack([members(ancestors[node]) for node in links])
    after = np.stack([members(descendants[node]) for node in links])
    ahead = before.astype(np.float64) @ compute  # the compute each collective waits for
    behind = after.astype(np.float64) @ compute  # the compute that waits for it
    between = (after * compute) @ before.T.astype(np.float64)  # [earlier, later]
    earlier = before[:, links]  # [later, earlier]: earlier is among later's ancestors
    link = cost[links]
    start = ahead.copy()  # the least time each collective can begin
    for later in range(len(links)):
        chained = np.flatnonzero(earlier[later, :later])
        if len(chained):
            reach = start[chained] + link[chained] + between[chained, later]
            start[later] = max(start[later], reach.max())
    chain = float((start + link + behind).max())
    return max(chain, float(compute.sum()), float(link.sum()))


@dataclass(frozen=True)
class Scheduled:
    step: float
    exposed: float
    link_behind: float  # of exposed: stalls while the link carried other collectives


@dataclass(frozen=True)
class Depth:
    blocks: int
    ops: int
    compute: float
    link: float
    bound: float
    schedules: dict[str, Scheduled]


def traced_depth(case: Case, blocks: int, schedules: Sequence[str]) -> Depth:
    """``case``'s step traced with ``blocks`` blocks: its bound, and each schedule's."""
    import scheduling
    from jaxmoe.plan.layer_extrapolation import with_blocks
    from jaxmoe.plan.tracer import trace, with_schedule
    from jaxmoe.train.resolved import schedule_policy
    from scheduling import Graph, batch_inputs, cost_model, node_seconds, simulate

    config = with_blocks(_config(case), blocks)
    traced = trace(config)
    program = traced.program
    cost = cost_model(
        schedule_policy(with_schedule(config, "none", PROFILE)), program.mesh, program
    ).priced_once()
    graph = Graph(program, lambda op: False)
    seconds = node_seconds(cost.rebound(program))
    costs = [seconds(node) for node in graph.nodes]
    collective = [node.is_collective for node in graph.nodes]
    bound = dependency_bound(graph.ancestors, graph.descendants, costs, collective)
    inputs = batch_inputs(program, traced.step.batch_argnums)
    found = {}
    for name in schedules:
        policy = schedule_policy(with_schedule(config, name, PROFILE))
        scheduled = scheduling.schedule(program, policy, cost, inputs)
        timeline = simulate(
            scheduled.graph,
            scheduled.order.nodes,
            node_seconds(cost.rebound(scheduled.graph.program)),
        )
        behind = sum(
            timing.stall for timing in timeline.collectives.values() if timing.began > timing.issued
        )
        found[name] = Scheduled(
            timeline.step_seconds, timeline.exposed_communication_seconds, behind
        )
    compute = sum(c for c, on_link in zip(costs, collective, strict=True) if not on_link)
    link = sum(c for c, on_link in zip(costs, collective, strict=True) if on_link)
    return Depth(blocks, len(program.ops), compute, link, bound, found)


def render(rows: list[tuple[Case, list[Depth]]], argv: Sequence[str]) -> str:
    lines = [
        "# Ordering schedules against the dependency bound",
        "",
        f"`{command_line('experiments.overlap_bound', argv)}` at {source_tree()}. Profile "
        f"`{PROFILE}`; times in ms. The bound: no order of the traced step's graph is "
        "shorter (experiments/overlap_bound.py). Of the exposed communication, *link behind*: "
        "stalls of collectives that waited for the link; the rest waited on windows that "
        "held too little compute.",
        "",
    ]
    for case, depths in rows:
        lines += [
            f"## {case.name} ({case.devices} devices, {case.batch} sequences)",
            "",
            "| blocks | ops | compute | link | bound | schedule | step | over the bound "
            "| exposed | link behind |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for depth in depths:
            for name, found in depth.schedules.items():
                lines.append(
                    f"| {depth.blocks} | {depth.ops} | {depth.compute * 1e3:.1f} "
                    f"| {depth.link * 1e3:.1f} | {depth.bound * 1e3:.1f} | `{name}` "
                    f"| {found.step * 1e3:.1f} | {found.step / depth.bound - 1:+.1%} "
                    f"| {found.exposed * 1e3:.1f} | {found.link_behind * 1e3:.1f} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--case",
        action="append",
        choices=[case.name for case in CASES],
        help=f"only this case (repeatable; default: {', '.join(DEFAULT_CASES)})",
    )
    parser.add_argument("--blocks", default="2,3", help="the depths traced, comma-separated")
    args = parser.parse_args(argv)
    names = args.case or DEFAULT_CASES
    depths = [int(blocks) for blocks in args.blocks.split(",")]
    rows = []
    for case in (case for case in CASES if case.name in names):
        rows.append((case, [traced_depth(case, blocks, SCHEDULES) for blocks in depths]))
        print(f"{case.name}: traced", flush=True)
    args.out.write_text(render(rows, argv))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
