"""How long the planner takes to price and trace steps and to bound states, against another tree.

    python -m experiments.plan_time --against DIR [--repeats 5] [--preset small]

In rounds that alternate the two source trees (each in a process of its own, with that
tree first on ``sys.path``), for a few mappings of the preset on 8 devices:

- *Pricing.* One and two blocks each, as the planner traces them, are traced once; then
  the pricing the planner does for every estimate (``jaxmoe/plan/tracer.py``: the
  scheduling layer's cost model, ``schedule`` and two-stream simulation under ``none``,
  ``dw``, ``lancet`` and ``pair``) is timed in CPU seconds, ``--repeats`` times. Each
  side's simulated step times are hashed: equal digests say both trees priced every
  program alike.
- *Tracing.* Then each mapping at the model's whole depth is traced once under each of
  ``model.recompute none`` and ``layer``, timed in CPU seconds (the process warm from the
  traces above, none of these shapes traced before under that recomputation). Each
  side's captured programs (every op's primitive, name stack and result types, and where
  its operands come from) are hashed: equal digests say both trees traced the same
  programs.

- *The state bound.* Then the planner's bound of the state per device
  (``jaxmoe/plan/tracer.py: state_bytes``) of every layout and ZeRO stage it takes of
  ``--state-model`` on ``--state-devices`` devices (the seeds' models: hundreds of
  layouts, each resolved at two shallow depths), timed in CPU seconds. Each side's bytes
  are hashed: equal digests say both trees bounded every layout alike.

Writes ``experiments/results/plan_time.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

from experiments.shared.other_tree import commit_of, naming_dir, run_in_tree
from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios

RESULTS = Path(__file__).parent / "results" / "plan_time.md"
ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("none", "dw", "lancet", "pair")  # the planner's
PROFILE = "h100-8x-nvlink-3200g"
# (ZeRO stage, expert, expert tensor): MoE layouts of the preset on 8 devices, attention 8 x 1.
MAPPINGS = ((1, 8, 1), (0, 2, 1), (1, 2, 4))


def _measure(
    preset_name: str,
    profile: str,
    schedules: list,
    mappings: list,
    repeats: int,
    state_model: str,
    state_devices: int,
) -> dict:
    """Run in the tree measured (its source is sent to a fresh process): the CPU seconds of
    each repeat of pricing every traced program, of tracing whole depths and of the state
    bounds, and digests of what each found."""
    import dataclasses
    import hashlib
    import time

    import scheduling
    from jaxmoe.config import ConfigError
    from jaxmoe.config.schedule import replace_section
    from jaxmoe.parallel.mesh import abstract_mesh
    from jaxmoe.plan.layer_extrapolation import with_blocks
    from jaxmoe.plan.mappings import Mapping, with_mapping
    from jaxmoe.presets import preset
    from jaxmoe.train.resolved import resolve, schedule_policy
    from jaxmoe.train.scheduled import capture_train_step
    from scheduling import Value, batch_inputs, cost_model

    config = preset(preset_name)
    traced = []
    for zero, expert, expert_tensor in mappings:
        mapping = Mapping(
            devices=8, tensor=1, expert_data=8 // (expert * expert_tensor), expert=expert,
            expert_tensor=expert_tensor, dispatcher="all_to_all", zero=zero,
        )  # fmt: skip
        mapped = with_mapping(config, mapping, 8)
        for blocks in (1, 2):
            shallow = with_blocks(mapped, blocks)
            program, step = capture_train_step(resolve(shallow, abstract_mesh(shallow.parallel)))
            traced.append((shallow, program, batch_inputs(program, step.batch_argnums)))

    def price() -> list:
        found = []
        for shallow, program, batch in traced:
            cost = None  # one model prices the program under every schedule, as the planner's
            for name in schedules:
                section = replace_section(shallow.schedule, name=name, profile=profile)
                try:
                    variant = dataclasses.replace(shallow, schedule=section)
                except ConfigError:
                    continue  # pair: one microbatch and no pipeline
                policy = schedule_policy(variant)
                if cost is None:
                    cost = cost_model(policy, program.mesh, program)
                    # as the planner prices (a tree from before the memo prices each time)
                    cost = cost.priced_once() if hasattr(cost, "priced_once") else cost
                scheduled = scheduling.schedule(program, policy, cost, batch)
                # as the planner reads it (a tree from before the kept timeline simulates the
                # order again)
                timeline = getattr(scheduled, "timeline", None) or scheduling.estimate(
                    scheduled.graph, scheduled.order, cost
                )
                found.append((name, timeline.step_seconds, timeline.exposed_communication_seconds))
        return found

    seconds, digests = [], set()
    for _ in range(repeats):
        started = time.process_time()
        found = price()
        seconds.append(time.process_time() - started)
        digests.add(hashlib.sha1(repr(found).encode()).hexdigest()[:12])

    trace_seconds, programs = {}, hashlib.sha1()
    for recompute in ("none", "layer"):
        started = time.process_time()
        for zero, expert, expert_tensor in mappings:
            mapping = Mapping(
                devices=8, tensor=1, expert_data=8 // (expert * expert_tensor), expert=expert,
                expert_tensor=expert_tensor, dispatcher="all_to_all", zero=zero,
                recompute=recompute,
            )  # fmt: skip
            whole = with_mapping(config, mapping, 8)
            program, _ = capture_train_step(resolve(whole, abstract_mesh(whole.parallel)))
            # Each op's primitive, name stack, result types and where its operands come from.
            made = {value: ("input", i) for i, value in enumerate(program.inputs)}
            for index, op in enumerate(program.ops):
                operands = [
                    made[atom] if isinstance(atom, Value) else str(atom.aval) for atom in op.inputs
                ]
                results = [str(value.aval) for value in op.outputs]
                programs.update(repr((op.primitive, op.name_stack, results, operands)).encode())
                made.update({value: (index, i) for i, value in enumerate(op.outputs)})
        trace_seconds[recompute] = time.process_time() - started

    from experiments.folding_models import planned_config
    from jaxmoe.plan.mappings import (
        context_degrees,
        enumerate_mappings,
        pipelines_of,
        with_options,
    )
    from jaxmoe.plan.options import Options, option_sets
    from jaxmoe.plan.tracer import state_bytes

    # The layouts and ZeRO stages whose state the planner bounds first (plan_mappings).
    seed = planned_config(state_model, state_devices, state_devices)
    per_node = scheduling.PROFILES[profile].devices_per_node
    space = enumerate_mappings(
        seed,
        state_devices,
        per_node,
        max_tensor=per_node,
        pipelines=pipelines_of(seed, state_devices, 2),
        contexts=context_degrees(seed, state_devices),
    )
    staged = [
        with_options(layout, Options(zero=zero), per_node).config
        for layout in space.valid
        for zero in sorted({o.zero for o in option_sets(layout.config, True)})
    ]
    staged = [config for config in staged if config is not None]
    started = time.process_time()
    held = [state_bytes(config) for config in staged]
    state_seconds = time.process_time() - started
    return {
        "seconds": seconds,
        "digests": sorted(digests),
        "programs": len(traced),
        "trace_seconds": trace_seconds,
        "trace_digest": programs.hexdigest()[:12],
        "state_configs": len(staged),
        "state_seconds": state_seconds,
        "state_digest": hashlib.sha1(repr(held).encode()).hexdigest()[:12],
    }


def _run(tree: Path, preset: str, repeats: int, state_model: str, state_devices: int) -> dict:
    """:func:`_measure` in a fresh process that imports ``tree``'s jaxmoe and scheduling."""
    arguments = (
        preset, PROFILE, list(SCHEDULES), list(MAPPINGS), repeats, state_model, state_devices
    )  # fmt: skip
    return run_in_tree(tree, _measure, arguments)


def report(
    rounds: list[tuple[dict, dict]],
    this: str,
    other: str,
    preset: str,
    argv: list[str],
    state_model: str = "",
) -> str:
    """The results file: each side's CPU seconds per round (the median of its repeats),
    the per-round ratios, and whether both priced alike."""
    here = [statistics.median(mine["seconds"]) for mine, _ in rounds]
    there = [statistics.median(theirs["seconds"]) for _, theirs in rounds]
    ratios = round_ratios(there, here)
    digests = {d for mine, theirs in rounds for d in (*mine["digests"], *theirs["digests"])}
    lines = [
        "# The planner's pricing, tracing and state bound: this tree against another",
        "",
        f"Command: `{command_line('experiments.plan_time', naming_dir(argv))}` (DIR: a checkout "
        "of the other tree)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores.",
        "",
        f"This tree: {this}. The other: {other}.",
        "",
        f"{rounds[0][0]['programs']} traced programs (the `{preset}` preset's "
        f"mappings {', '.join(map(str, MAPPINGS))} as (ZeRO, expert, expert tensor), one and "
        f"two blocks), priced under {', '.join(SCHEDULES)} where each applies; CPU seconds "
        "of one pricing of all of them, the median of each process's repeats, the two trees "
        "alternating round by round.",
        "",
        "| round | this tree s | other tree s | other / this |",
        "|---|---|---|---|",
        *(
            f"| {i + 1} | {a:.2f} | {b:.2f} | {r:.2f} |"
            for i, (a, b, r) in enumerate(zip(here, there, ratios, strict=True))
        ),
        "",
        f"This tree {Spread.of(here).format(1, 2)} s, the other "
        f"{Spread.of(there).format(1, 2)} s (median [range]); other / this "
        f"{Spread.of(ratios).format(1, 2)}.",
        "",
        "Priced alike (the simulated steps' digests equal): "
        + ("yes." if len(digests) == 1 else f"no ({len(digests)} digests)."),
        "",
    ]
    if all("trace_seconds" in side for pair in rounds for side in pair):
        lines += _tracing(rounds)
    if all("state_seconds" in side for pair in rounds for side in pair):
        lines += _state_bounds(rounds, state_model)
    return "\n".join(lines)


def _tracing(rounds: list[tuple[dict, dict]]) -> list[str]:
    """The tracing table: each side's CPU seconds per round and recomputation, the ratios,
    and whether both traced the same programs."""
    recomputes = list(rounds[0][0]["trace_seconds"])
    lines = [
        "## Tracing",
        "",
        f"The same mappings at the model's whole depth, each traced once per round under "
        f"`model.recompute` {' and '.join(recomputes)}: CPU seconds of tracing all of them.",
        "",
        "| round | recompute | this tree s | other tree s | other / this |",
        "|---|---|---|---|---|",
    ]
    summary = []
    for recompute in recomputes:
        here = [mine["trace_seconds"][recompute] for mine, _ in rounds]
        there = [theirs["trace_seconds"][recompute] for _, theirs in rounds]
        ratios = round_ratios(there, here)
        lines += [
            f"| {i + 1} | {recompute} | {a:.2f} | {b:.2f} | {r:.2f} |"
            for i, (a, b, r) in enumerate(zip(here, there, ratios, strict=True))
        ]
        summary.append(
            f"- `{recompute}`: this tree {Spread.of(here).format(1, 2)} s, the other "
            f"{Spread.of(there).format(1, 2)} s; other / this {Spread.of(ratios).format(1, 2)}."
        )
    digests = {side["trace_digest"] for pair in rounds for side in pair}
    return [
        *lines,
        "",
        *summary,
        "",
        "Traced alike (the programs' digests equal): "
        + ("yes." if len(digests) == 1 else f"no ({len(digests)} digests)."),
        "",
    ]


def _state_bounds(rounds: list[tuple[dict, dict]], model: str) -> list[str]:
    """The state bounds' table: each side's CPU seconds per round, the ratios, and whether
    both bounded alike."""
    here = [mine["state_seconds"] for mine, _ in rounds]
    there = [theirs["state_seconds"] for _, theirs in rounds]
    ratios = round_ratios(there, here)
    digests = {side["state_digest"] for pair in rounds for side in pair}
    return [
        "## The state bound",
        "",
        f"The state per device (parameters and optimizer state) that the planner bounds "
        f"first, of each of `{model}`'s {rounds[0][0]['state_configs']} layouts and ZeRO "
        "stages (each resolved at two shallow depths): CPU seconds of bounding all of them.",
        "",
        "| round | this tree s | other tree s | other / this |",
        "|---|---|---|---|",
        *(
            f"| {i + 1} | {a:.1f} | {b:.1f} | {r:.2f} |"
            for i, (a, b, r) in enumerate(zip(here, there, ratios, strict=True))
        ),
        "",
        f"This tree {Spread.of(here).format(1, 1)} s, the other "
        f"{Spread.of(there).format(1, 1)} s; other / this {Spread.of(ratios).format(1, 2)}.",
        "",
        "Bounded alike (the bytes' digests equal): "
        + ("yes." if len(digests) == 1 else f"no ({len(digests)} digests)."),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, help="another checkout's root")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="pricings in each process")
    parser.add_argument("--state-model", default="qwen2-57b-a14b", help="whose state to bound")
    parser.add_argument("--state-devices", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds = []
    for index in range(args.rounds):
        # Alternate which tree goes first, so neither always runs on a warmer host.
        trees = (ROOT, args.against) if index % 2 == 0 else (args.against, ROOT)
        found = {
            tree: _run(tree, args.preset, args.repeats, args.state_model, args.state_devices)
            for tree in trees
        }
        rounds.append((found[ROOT], found[args.against]))
        print(f"round {index + 1}: {found[ROOT]} against {found[args.against]}")
    args.out.write_text(
        report(
            rounds, commit_of(ROOT), commit_of(args.against), args.preset, argv, args.state_model
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
