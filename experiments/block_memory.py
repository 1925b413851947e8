"""What one block of a seed model keeps for its backward pass, by the op that made each
value: where a mapping's activation memory goes.

    python -m experiments.block_memory [--out experiments/results/block_memory.md]

Each case is a seed model cut to one block (one MoE layer), mapped as the planner maps it
(:mod:`jaxmoe.plan.mappings`) with one sequence of 4096 tokens per data replica, traced on
an abstract mesh of its devices; the planner's memory walk (:mod:`jaxmoe.plan.memory`)
tells which buffers are alive when the backward pass begins. Those made in the block's
scope are grouped by the op that made them (primitive, scope inside the block, dtype and
shape), largest first; the block's weights that ZeRO-1 gathered (once, held to the
backward pass) are counted apart, as the walk counts them. The cases put Megatron-Core's
Mixtral 8x22B layout (tensor 2 with sequence parallelism, experts over 8, no
recomputation) beside the same without tensor parallelism, where a device holds a whole
sequence.

Memory, not timings: the same on every run.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

from experiments.shared.results_file import command_line, source_tree

RESULTS = Path(__file__).parent / "results" / "block_memory.md"
DEVICES = 128
# (label, model, mapping fields): attention data x tensor, MoE expert data x expert x
# expert tensor, ZeRO-1, nothing recomputed.
CASES = (
    ("Megatron-Core's layout", "mixtral-8x22b", dict(tensor=2, expert_data=16, expert=8)),
    ("without tensor parallelism", "mixtral-8x22b", dict(tensor=1, expert_data=16, expert=8)),
)
ROWS = 16  # the largest groups shown per case


def kept_by_op(model: str, fields: dict) -> dict:
    """The block's kept buffers grouped by the op that made them, and the totals."""
    from experiments.folding_models import planned_config
    from jaxmoe.parallel.zero import GATHER_SCOPE
    from jaxmoe.plan.layer_extrapolation import with_blocks
    from jaxmoe.plan.mappings import Mapping, with_mapping
    from jaxmoe.plan.memory import backward_start
    from jaxmoe.plan.tracer import trace
    from scheduling import aval_bytes

    mapping = Mapping(
        devices=DEVICES, expert_tensor=1, dispatcher="all_to_all", zero=1, recompute="none",
        **fields,
    )  # fmt: skip
    replicas = mapping.attention_data
    config = with_blocks(with_mapping(planned_config(model, DEVICES, replicas), mapping, 8), 1)
    traced = trace(config)
    start = backward_start(traced.program, traced.run.state_shapes, re.compile(r"layer_"))
    made_by = {value: op for op in traced.program.ops for value in op.outputs}
    groups: collections.Counter = collections.Counter()
    parameters = 0
    for value, in_block in start.kept.items():
        op = made_by.get(value)
        if not in_block or op is None:
            continue
        if op.primitive == "all_gather" and GATHER_SCOPE in op.layer:
            parameters += aval_bytes(value.aval)  # ZeRO-1 gathers the block's weights once
            continue
        scope = re.sub(r"^.*?layer_\d+/?", "", op.layer) or "(the block)"
        key = (op.primitive, scope, str(value.aval.dtype), tuple(value.aval.shape))
        groups[key] += aval_bytes(value.aval)
    tokens = config.model.seq_len // mapping.tensor  # sequence parallel over the tensor group
    return {
        "label": mapping.label(),
        "tokens": tokens,
        "groups": groups.most_common(),
        "block": sum(groups.values()),
        "parameters": parameters,
        "all": start.bytes()[0],
    }


def render(found: list[tuple[str, str, dict]], argv: list[str]) -> str:
    lines = [
        "# What one block keeps for its backward pass",
        "",
        f"Command: `{command_line('experiments.block_memory', argv)}` (at {source_tree()})",
        "",
        f"One MoE block of each model, {DEVICES} devices, one sequence of 4096 tokens per "
        "data replica, the flash attention core the planner traces; the buffers alive when "
        "the backward pass begins that the block's ops made, as the planner's memory walk "
        "holds them (jaxmoe/plan/memory.py), grouped by the op that made them. MB are 1e6 "
        "bytes.",
        "",
    ]
    for label, model, kept in found:
        per_token = kept["block"] / kept["tokens"]
        lines += [
            f"## {model}, {label}: {kept['label']}",
            "",
            f"{kept['block'] / 1e6:.1f} MB of activations in the block, for the "
            f"{kept['tokens']} tokens a device holds: {per_token / 1e3:.1f} kB a token; "
            f"beside them {kept['parameters'] / 1e6:.1f} MB of the block's weights as ZeRO-1 "
            f"gathered them ({kept['all'] / 1e6:.1f} MB alive in all).",
            "",
            "| MB | share | made by | scope in the block | dtype | shape |",
            "|---|---|---|---|---|---|",
        ]
        for (primitive, scope, dtype, shape), size in kept["groups"][:ROWS]:
            lines.append(
                f"| {size / 1e6:.1f} | {size / kept['block']:.0%} | `{primitive}` | {scope} "
                f"| {dtype} | {list(shape)} |"
            )
        rest = kept["groups"][ROWS:]
        if rest:
            size = sum(size for _, size in rest)
            lines.append(
                f"| {size / 1e6:.1f} | {size / kept['block']:.0%} | {len(rest)} more | | | |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    found = [(label, model, kept_by_op(model, fields)) for label, model, fields in CASES]
    args.out.write_text(render(found, argv))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
