"""Fitting the seeds' models on H100 clusters and DeepSeek-V3 on B200 and H100 clusters,
in the simulator, and each memory-saving option measured on 8 CPU devices.

Part 1 (the planner, ``jaxmoe plan``): Mixtral 8x22B and Qwen2-57B-A14B, their published
architectures (:mod:`experiments.folding_models`), on 64, 128 and 256 H100s of the
profile ``h100-8x-nvlink-3200g`` (8 per node, 80 GB each) at one sequence per device, and
at Megatron-Core's recipe (its devices and global batch), where its MFU was measured. The
planner searches every layout with every ZeRO stage, recomputation, number of
microbatches and pipeline (:mod:`jaxmoe.plan.planner`) under every schedule and
estimates the best that fit 80 GB; the best one is set against Megatron-Core's published
MFU on H100s (MoE Parallel Folding: 49.3% for Mixtral 8x22B, 39.0% for Qwen2-57B-A14B),
with what the estimate says the gap is made of; part ``exposed`` breaks each best
mapping's exposed communication down by what each collective is for
(:mod:`experiments.exposed_communication`), and part ``estimate`` estimates each stored
best mapping again with the planner as it is now, where the planner has changed since
its search (the search itself is not run again: the report says so).

Megatron-Core's own mappings of the two models (:mod:`experiments.published_recipes`) are
estimated by the same planner. Mixtral 8x22B at 32K and 128K tokens a sequence, with
context parallelism, is searched as :mod:`experiments.long_context` says (part ``long``);
DeepSeek-V3 in FP8 on Megatron-Core's B200 and H100 systems, beside its published
throughput, as :mod:`experiments.deepseek_v3_fit` says (part ``deepseek``).

Part 2 (8 CPU devices, XLA:CPU; :mod:`experiments.cpu_options`): a small model with each
option against the plain step: the compiled memory (XLA's memory analysis) beside the
memory walk of :mod:`jaxmoe.plan.memory` (as XLA:CPU and as XLA:GPU hold it), and the
step time over repeated steps.

A search takes minutes to an hour here, so each run does the parts and searches it is
asked for and keeps the rest from the earlier runs (``scale_eval.json`` beside the
report); the report names every command that made it.

    python -m experiments.scale_eval [--models M,...] [--devices 64,128,256,recipe]
        [--parts planner,estimate,exposed,recipes,long,deepseek,cpu] [--top 10]
        [--time-limit S]
        [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from experiments import deepseek_v3_fit, long_context
from experiments.cpu_options import CPU_DEVICES, cpu_rows, measure_options_on_cpu
from experiments.exposed_communication import ExposedCommunication, exposed_communication
from experiments.folding_models import MODELS, SEQ_LEN, SEQUENCES_PER_DEVICE, planned_config
from experiments.published_recipes import (
    PUBLISHED_ROW,
    RECIPES,
    RECOMPUTED_ROW,
    SOURCE,
    RecipeEstimate,
    estimate_in_fresh_process,
    recipe_mappings,
)
from experiments.shared.results_file import command_line, kept_section, source_tree
from jaxmoe.pipeline.ticks import tick_table
from jaxmoe.plan.options import PLANNED_RECOMPUTE
from jaxmoe.plan.search import most_over_least

if TYPE_CHECKING:
    from jaxmoe.plan.planner import MappingEstimate

RESULTS = Path(__file__).parent / "results"
PROFILE = "h100-8x-nvlink-3200g"
# Why the planner left a mapping out (jaxmoe.plan.planner.NotEstimated.kind).
KINDS = ("state", "memory", "step", "refused", "recompute", "time")
# A search at a model's recipe's devices and global batch (``--devices``).
RECIPE = "recipe"
# The schedules the planner estimates for every mapping; the fastest counts.
SCHEDULES = ("none", "dw", "lancet", "pair")
# Megatron-Core's MFU on H100s (MoE Parallel Folding, arXiv 2504.14960, abstract).
PUBLISHED_MFU = {"mixtral-8x22b": 0.493, "qwen2-57b-a14b": 0.390}
LEFT_OUT = [
    "Lancet's forward partitioning cuts a device's rows into chunks (scheduling/search/"
    "partition_search.py: the chunk counts that divide them). At one sequence a device "
    "it has nothing to cut, so `lancet` schedules as `dw` does there, and the forward "
    "pass's exchanges hide only behind what happens to be ready beside them (the best "
    "mappings' waits above). Cutting along the sequence's tokens instead is not built. "
    "At the recipes (two and four sequences a device) it cuts ranges through the flash "
    "attention core the planner traces, a `lax.scan` over tiles that each chunk runs "
    "rebuilt at its size (scheduling/program/batch_layout.py); a range then reassembles "
    "the values read after it, the backward pass's among them, from its chunks, a copy "
    "the estimate charges.",
    "Everything here is simulated: step times are the scheduler's cost model and "
    "two-stream simulator on the H100 profile, not runs on H100s; memory is the walk of "
    "the traced per-device step (part 2 checks it against XLA:CPU), not a GPU's.",
    f"The batch of the searches on N devices: {SEQUENCES_PER_DEVICE} sequence of {SEQ_LEN} "
    "tokens per device per step (N sequences); the recipes' global batch of 256 is larger, "
    "which amortises the gradient synchronisation and a pipeline's idle ticks over more "
    "tokens (the searches at the recipes' settings have it).",
    "Kernels: the cost model prices XLA's fusions (scheduling/costs/fusion.py; against the "
    "optimized HLO of an H100 module its bytes are 0.98 of XLA's for matmuls and 0.89 for "
    "the rest, with 787 kernels to XLA's 982: experiments/results/fusion_check.md; rows "
    "searched before 133094b were priced with the rest at 1.11 and slices and updates in "
    "place at their whole buffers), matmuls at 79% of the bfloat16 peak "
    "(one measured point on an H200), and the attention core as cuDNN's flash attention, "
    "one kernel (traced blockwise here, where cuDNN cannot be traced). No grouped GEMM "
    "kernel: the experts' products are batched matmuls over padded buffers.",
    "Microbatches: without a pipeline, from six on, at most three are in flight (each "
    "waits for the backward pass three before it; jaxmoe/pipeline/microbatches.py; fewer "
    "run their forward passes first), and the walk runs "
    "their forward passes as early as that allows; XLA:CPU holds up to a quarter more "
    "there (tests/plan/test_memory.py). A pipeline's ticks are walked in "
    "their order, which is below what XLA:CPU holds (part 2: the walk's ratio to XLA's "
    "peak), so pipelines near the limit may fit here and not on a "
    "device whose compiler runs later ticks' forward slots early.",
    "Attention: the flash core keeps q, k, v, its output and a log-sum-exp per row, "
    "nothing of [seq, seq], as Megatron-Core's does.",
]


@dataclass(frozen=True)
class Search:
    """One planner search of part 1, as the results keep it."""

    model: str
    devices: int
    batch: int  # sequences a step
    layouts: int  # valid layouts searched
    estimated: int
    fitting: int  # of the estimated, those that fit 80 GB
    left_out: dict[str, int]  # mappings not estimated, by why: state, memory, step, refused
    wall: float  # seconds
    cpu: float
    best: MappingEstimate | None  # the best that fits (None: none fits)
    command: str  # the run that made it
    complete: bool = True  # the best proven the best (False: --time-limit stopped it)
    seq_len: int = SEQ_LEN  # tokens a sequence
    profile: str = PROFILE  # the cost model's device profile
    # The best mapping's communication by purpose (part exposed), where it was broken down.
    exposed: ExposedCommunication | None = None
    exposed_command: str = ""  # the run that broke it down
    # The run that estimated the best mapping again after its search (part estimate).
    estimate_command: str = ""
    # Where the time limit stopped it: the least step bound (seconds) of the mappings left
    # under the best; no mapping is faster (None: complete, or stopped without one).
    least_bound: float | None = None

    def proven(self) -> str:
        """Whether the best is proven the best, or how far from it it may be."""
        if self.complete:
            return "yes"
        said = "no: stopped at the time limit"
        if self.least_bound is None or self.best is None:
            return said
        slower = most_over_least(self.best.best.step, self.least_bound)
        return f"{said}; at most {slower:.0%} slower than the best of all"

    @property
    def key(self) -> tuple[str, int, int, int, str]:
        return (self.model, self.devices, self.batch, self.seq_len, self.profile)

    @property
    def long(self) -> bool:
        """A search of :mod:`experiments.long_context` (longer sequences)."""
        return self.seq_len != SEQ_LEN

    @property
    def deepseek(self) -> bool:
        """A search of :mod:`experiments.deepseek_v3_fit`."""
        return self.model == deepseek_v3_fit.MODEL

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["best"] = self.best.to_json() if self.best is not None else None
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> Search:
        from jaxmoe.plan.planner import MappingEstimate

        best = data["best"]
        exposed = data.get("exposed")
        return Search(
            **{
                **data,
                "best": best and MappingEstimate.from_json(best),
                "exposed": exposed and ExposedCommunication.from_json(exposed),
            }
        )


def searches_of(models: Sequence[str], devices: Sequence[str]) -> list[tuple[str, int, int]]:
    """The (model, devices, batch) of each search ``--devices`` names: a number of devices
    at one sequence each, or ``recipe``: the model's recipe's devices and global batch."""
    found = []
    for model in models:
        for entry in devices:
            if entry == RECIPE:
                recipe = RECIPES[model]
                found.append((model, recipe.devices, recipe.global_batch))
            else:
                found.append((model, int(entry), int(entry) * SEQUENCES_PER_DEVICE))
    return found


def plan_one(
    model: str,
    devices: int,
    batch: int,
    top: int,
    command: str,
    time_limit: float | None,
    seq_len: int = SEQ_LEN,
    profile: str = PROFILE,
) -> Search:
    """The planner's search for ``model`` on ``devices`` devices of ``profile`` at
    ``batch`` sequences a step, timed (no cache), stopped after ``time_limit`` seconds
    where given. Longer sequences than the pretraining length search
    :mod:`experiments.long_context`'s layouts, DeepSeek-V3
    :mod:`experiments.deepseek_v3_fit`'s; neither with a pipeline."""
    from jaxmoe.plan.planner import plan_mappings

    if model == deepseek_v3_fit.MODEL:
        run = deepseek_v3_fit.published(profile, devices)
        config, layouts = deepseek_v3_fit.config(batch, devices), deepseek_v3_fit.searched(run)
    elif seq_len != SEQ_LEN:
        config, layouts = long_context.config(seq_len, devices), long_context.searched
    else:
        config, layouts = planned_config(model, devices, batch), None
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan_mappings(
        config,
        model,
        devices,
        profile,
        SCHEDULES,
        top=top,
        progress=lambda line: print(line, flush=True),
        time_limit=time_limit,
        pipeline=layouts is None,
        layouts=layouts,
        options=model != deepseek_v3_fit.MODEL,  # its options fixed: deepseek_v3_fit.OPTIONS
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{model} on {devices}: {len(result.estimates)} estimated, {wall:.0f} s", flush=True)
    left_out = dict.fromkeys(KINDS, 0)
    for item in result.not_estimated:
        left_out[item.kind] += 1
    return Search(
        model,
        devices,
        batch,
        len(result.space.valid),
        len(result.estimates),
        len(result.ranked),
        left_out,
        wall,
        cpu,
        result.ranked[0] if result.ranked else None,
        command,
        result.complete,
        seq_len,
        profile,
        least_bound=result.least_bound_left,
    )


def _gb(size: float) -> str:
    return f"{size / 1e9:.1f}"


def _at_recipe(search: Search) -> bool:
    recipe = RECIPES[search.model]
    return (search.devices, search.batch) == (recipe.devices, recipe.global_batch)


def planner_rows(searches: Sequence[Search]) -> list[str]:
    lines = [
        "| model | devices | sequences a step | layouts | estimated | fit 80 GB | not "
        "estimated (state / memory, bound or traced / step bound / refused / less "
        "recomputation fits / time) | planner s (CPU s) | best proven |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for search in searches:
        kinds = search.left_out
        lines.append(
            f"| {search.model} | {search.devices} | {search.batch} | {search.layouts} | "
            f"{search.estimated} | {search.fitting} | "
            f"{' / '.join(str(kinds.get(k, 0)) for k in KINDS)} | "
            f"{search.wall:.0f} ({search.cpu:.0f}) | "
            f"{search.proven()} |"
        )
    return lines


def best_rows(searches: Sequence[Search]) -> list[str]:
    lines = [
        "| model | devices | sequences a step | best mapping that fits | schedule | step ms | "
        "compute ms | exposed comm ms | MFU | MFU of its compute alone | published MFU | "
        "target met | GB/device (master / optim / params / activ / backward) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for search in searches:
        head = f"| {search.model} | {search.devices} | {search.batch} |"
        best = search.best
        if best is None:
            lines.append(f"{head} none fits |" + " |" * 9)
            continue
        t, m = best.best, best.memory
        compute_mfu = best.mfu * t.step / t.compute if t.compute else 0.0
        parts = " / ".join(
            _gb(getattr(m, k))
            for k in ("master", "optimizer", "parameters", "activations", "backward")
        )
        published = PUBLISHED_MFU[search.model]
        met = ("yes" if best.mfu >= published else "no") if _at_recipe(search) else "-"
        lines.append(
            f"{head} {best.mapping.label()} | "
            f"`{best.schedule}` | {t.step * 1e3:.0f} | {t.compute * 1e3:.0f} | "
            f"{t.exposed_communication * 1e3:.0f} | {best.mfu:.1%} | {compute_mfu:.1%} | "
            f"{published:.1%} | {met} | {_gb(best.peak_bytes)} ({parts}) |"
        )
    return lines


def gap_lines(searches: Sequence[Search]) -> list[str]:
    """For each best mapping, what its step is made of, from the estimate."""
    lines = []
    for search in searches:
        best = search.best
        if best is None:
            continue
        t, mapping = best.best, best.mapping
        published = PUBLISHED_MFU[search.model]
        parts = [
            f"exposed communication is {t.exposed_communication / t.step:.0%} of the step",
            f"computation alone would give {best.mfu * t.step / t.compute:.1%} MFU"
            if t.compute
            else "no computation",
        ]
        if mapping.recompute == "layer":
            parts.append("every block's forward pass runs twice (full recomputation)")
        elif mapping.recompute == "attention":
            parts.append("the core attention runs twice (selective recomputation)")
        elif mapping.recompute == "matmuls":
            parts.append(
                "the backward pass recomputes the norms, activations, routing and the "
                "attention core, no matmul of a weight (the matmuls' results kept)"
            )
        if mapping.pipeline > 1:
            bubble = (mapping.pipeline - 1) / (mapping.microbatches * mapping.virtual_stages)
            parts.append(f"the pipeline's idle ticks add {bubble:.0%} to its work")
        if search.exposed is not None:
            parts.append(_exposed_by_purpose(search.exposed))
        if search.estimate_command:
            parts.append(
                f"estimated again by the planner as `{search.estimate_command}` ran it, "
                "after its search, which was not run again"
            )
        where = f"{search.model} on {search.devices} at {search.batch} sequences"
        lines.append(
            f"- {where}: {best.mfu:.1%} against {published:.1%} published; "
            + "; ".join(parts)
            + "."
        )
    return lines


def _exposed_by_purpose(exposed: ExposedCommunication) -> str:
    """What the compute stream waits for (part exposed), longest first."""
    waits = ", ".join(
        f"{purpose} {seconds * 1e3:.0f} ms (its transfers {linked * 1e3:.0f})"
        for purpose, seconds, linked in exposed.largest(4, least=5e-4)
    )
    cut = (
        f"; it partitioned {exposed.partitioned_ranges} forward range(s)"
        if exposed.partitioned_ranges
        else ""
    )
    return f"under `{exposed.schedule}` the compute stream waits for {waits}{cut}"


def recipe_rows(estimates: Sequence[Any]) -> list[str]:
    lines = [
        "| model | mapping | estimated | step s | compute s | exposed comm s | pipeline "
        "idle | MFU | MFU of its compute alone | published MFU | GB/device (activ) | fits "
        "80 GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in estimates:
        t, m = e.time, e.memory
        label = RECIPES[e.model].label()
        if t is None or m is None:
            lines.append(
                f"| {e.model} | {label} | {e.row}: not estimated, {e.left_out} |" + " |" * 9
            )
            continue
        lines.append(
            f"| {e.model} | {label} | {e.row} | {t.step:.2f} | {t.compute:.2f} | "
            f"{t.exposed_communication:.2f} | {e.idle_share:.0%} | {e.mfu:.1%} | "
            f"{e.mfu * t.step / t.compute:.1%} | {PUBLISHED_MFU[e.model]:.1%} | "
            f"{_gb(m.total)} ({_gb(m.activations)}) | {'yes' if m.total <= 80e9 else 'no'} |"
        )
    return lines


def recipe_lines(estimates: Sequence[Any]) -> list[str]:
    """For each recipe, what its estimate says the gap to the published MFU is made of."""
    lines = []
    for model in dict.fromkeys(e.model for e in estimates):
        rows = {e.row: e for e in estimates if e.model == model}
        published, recomputed = rows[PUBLISHED_ROW], rows[RECOMPUTED_ROW]
        if published.time is None or published.memory is None:
            lines.append(
                f"- {model}: the recipe as published was not estimated: {published.left_out}."
            )
            continue
        t, mapping = published.time, published.mapping
        recipe = RECIPES[model]
        held = tick_table(
            mapping.pipeline, mapping.virtual_stages, mapping.microbatches
        ).residuals_held
        parts = [
            f"the recipe as published estimates {published.mfu:.1%} MFU against "
            f"{PUBLISHED_MFU[model]:.1%} measured",
            f"its pipeline idles {published.idle_share:.0%} of its work ((P - 1) / (M V) "
            f"with P = {mapping.pipeline}, M = {mapping.microbatches}, V = "
            f"{mapping.virtual_stages})",
            f"exposed communication is {t.exposed_communication / t.step:.0%} of the step",
            f"computation alone would give {published.mfu * t.step / t.compute:.1%}",
            f"it needs {_gb(published.memory.total)} GB per device here, "
            f"{_gb(published.memory.activations)} GB of it activations (every device "
            f"of the one SPMD program holds the residuals of up to {held} forward slots, "
            "each one microbatch's through one chunk"
            + (
                f"; Megatron-Core's 1F1B holds {mapping.pipeline} on its first stage)"
                if mapping.virtual_stages == 1
                else ")"
            ),
        ]
        if recomputed.memory is None:
            parts.append(
                f"with full-layer recomputation it was not estimated: {recomputed.left_out}"
            )
        else:
            parts.append(
                f"with full-layer recomputation it needs {_gb(recomputed.memory.total)} GB "
                f"({'fits' if recomputed.memory.total <= 80e9 else 'does not fit'}) at "
                f"{recomputed.mfu:.1%} MFU"
            )
        lines.append(f"- {model} on {recipe.devices}: " + "; ".join(parts) + ".")
    return lines


@dataclass
class Store:
    """What the runs of this experiment made, kept beside the report
    (``scale_eval.json``): each run replaces what it reran and keeps the rest, so the
    report holds every search made so far, each with its command."""

    searches: list[Search] = dataclasses.field(default_factory=list)
    recipes: list[tuple[str, RecipeEstimate]] = dataclasses.field(default_factory=list)
    cpu: dict[str, Any] | None = None  # part 2: its command, repeats and rows
    # Each command's source tree when it last ran ("at" results_file.source_tree), or the
    # commit that recorded what it made.
    trees: dict[str, str] = dataclasses.field(default_factory=dict)

    @staticmethod
    def load(path: Path) -> Store:
        if not path.exists():
            return Store()
        data = json.loads(path.read_text())
        return Store(
            [Search.from_json(search) for search in data["searches"]],
            [
                (row["command"], RecipeEstimate.from_json(row["estimate"]))
                for row in data["recipes"]
            ],
            data["cpu"],
            data.get("trees", {}),
        )

    def save(self, path: Path) -> None:
        data = {
            "searches": [search.to_json() for search in self.searches],
            "recipes": [{"command": c, "estimate": e.to_json()} for c, e in self.recipes],
            "cpu": self.cpu,
            "trees": self.trees,
        }
        path.write_text(json.dumps(data, indent=1) + "\n")

    def add_search(self, search: Search) -> None:
        kept = [s for s in self.searches if s.key != search.key]
        order = [*MODELS, deepseek_v3_fit.MODEL]
        self.searches = sorted(
            [*kept, search],
            key=lambda s: (s.seq_len, order.index(s.model), s.devices, s.batch),
        )

    def add_recipes(self, model: str, command: str, estimates: Sequence[RecipeEstimate]) -> None:
        kept = [(c, e) for c, e in self.recipes if e.model != model]
        order = list(MODELS)
        rows = [*kept, *((command, e) for e in estimates)]
        self.recipes = sorted(rows, key=lambda row: order.index(row[1].model))

    def commands(self) -> list[str]:
        found = [s.command for s in self.searches] + [c for c, _ in self.recipes]
        found += [s.exposed_command for s in self.searches if s.exposed_command]
        found += [s.estimate_command for s in self.searches if s.estimate_command]
        return list(dict.fromkeys([*found, *([self.cpu["command"]] if self.cpu else [])]))


# The report's sections whose part a run may not have made yet: kept from the report it
# overwrites (experiments.shared.results_file.kept_section), or left out.
RECIPES_HEADING = "## Megatron-Core's own mappings, estimated by the same planner"
LONG_HEADING = "## Long sequences: Mixtral 8x22B at 32K and 128K tokens, context parallel"
DEEPSEEK_HEADING = "## DeepSeek-V3 in FP8 on B200s and H100s, beside Megatron-Core's figures"
CPU_HEADING = f"## Each option on {CPU_DEVICES} CPU devices"
LEFT_OUT_HEADING = "## What this leaves out"


def report(store: Store, earlier: Path | None = None) -> str:
    """The report of what ``store`` holds; a part it does not hold yet is kept from the
    ``earlier`` report where that has it."""
    lines = [
        "# Fitting the seeds' models on H100 clusters and DeepSeek-V3 on B200 and H100 "
        "clusters (simulated), and the options on 8 CPU devices",
        "",
        "Made by (each run keeps what the others made: experiments/results/scale_eval.json)",
        "",
        *(
            f"    {command}" + (f"  # {store.trees[command]}" if command in store.trees else "")
            for command in store.commands()
        ),
        "",
    ]
    searches = [s for s in store.searches if not (s.long or s.deepseek)]
    long = [search for search in store.searches if search.long]
    deepseek = [search for search in store.searches if search.deepseek]
    if searches:
        lines += [
            "## The planner: Mixtral 8x22B and Qwen2-57B-A14B on H100s",
            "",
            f"Profile `{PROFILE}` (8 H100s per node over NVLink, 400 Gbit/s per GPU between "
            f"nodes, 80 GB per device); sequences of {SEQ_LEN} tokens, bfloat16 "
            "activations, capacity factor 1.0, the flash attention core. Each model is "
            f"searched on N devices at {SEQUENCES_PER_DEVICE} sequence per device per step, "
            "and at Megatron-Core's recipe (its devices and global batch: "
            + ", ".join(
                f"{model} {recipe.devices} GPUs, {recipe.global_batch} sequences"
                for model, recipe in RECIPES.items()
            )
            + "), where the published MFU was measured. The planner searches every layout "
            "(tensor groups inside a node), ZeRO stage (0, 1, 3; 0 and 1 with a pipeline), "
            f"recomputation ({', '.join(r for r in PLANNED_RECOMPUTE if r != 'attention')}), "
            "number of microbatches and pipeline "
            "(stages dividing the devices, 1 or 2 virtual stages, chunks of whole blocks, "
            "uneven where they do not divide), and estimates each mapping under the schedules "
            f"{', '.join(f'`{name}`' for name in SCHEDULES)} (the fastest counts); it "
            "estimates, least step-time bound first, until "
            "the best that fit 80 GB are known (jaxmoe/plan/planner.py). Planner seconds are "
            "each search's, without the estimate cache, on a 2-core machine shared with "
            "other work (CPU seconds beside). A search its time limit stopped says, where "
            "it recorded the least bound it left, how much slower its best may be than the "
            "best of all: no mapping left is faster than that bound.",
            "",
            *planner_rows(searches),
            "",
            "The best mapping that fits, against Megatron-Core's published MFU on H100s (MoE "
            "Parallel Folding), which is met or not at the recipe's devices and batch. Memory "
            "per device at the step's peak, as XLA:GPU would hold the traced step "
            "(jaxmoe/plan/memory.py).",
            "",
            *best_rows(searches),
            "",
            "What the gaps are made of (from each estimate):",
            "",
            *gap_lines(searches),
            "",
        ]
    recipes = [estimate for _, estimate in store.recipes]
    if not recipes and earlier is not None:
        lines += kept_section(earlier, RECIPES_HEADING, "\n## ", "--parts")
    if recipes:
        lines += [
            RECIPES_HEADING,
            "",
            f"{SOURCE}: sequences of {SEQ_LEN}, micro-batches of 1 sequence, each recipe's "
            "global batch (the rows of a data replica in that many microbatches), the "
            "distributed optimizer (ZeRO-1), ETP 1, the all-to-all dispatcher, no "
            "recomputation; the paper's own table of settings is not reproduced here. "
            "Each is estimated as the planner estimates any mapping (profile, schedule "
            "`none` and memory walk as above; experiments/published_recipes.py), with "
            "full-layer recomputation beside it. "
            "*Pipeline idle*: the idle ticks over the work, (P - 1) / (M V).",
            "",
            *recipe_rows(recipes),
            "",
            *recipe_lines(recipes),
            "",
        ]
    if long:
        lines += [
            LONG_HEADING,
            "",
            "Searched as above (profile, schedules, memory walk), with the tokens of a step "
            f"kept at the 4K recipe's ({long_context.TOKENS_PER_STEP} tokens), the recipe's "
            f"tensor degree ({long_context.TENSOR}) and MoE layout (expert groups of "
            f"{long_context.EXPERT_GROUP}, whole experts, the all-to-all dispatcher) and no "
            "pipeline: every context degree whose chunks hold at least 2048 positions (and "
            "none), ring or all-gathered keys and values, ZeRO stage, recomputation and "
            "number of microbatches; routing groups of "
            f"{long_context.GROUP_SIZE} tokens, inside each device's share of a sequence "
            "(experiments/long_context.py).",
            "",
            *long_context.rows(long),
            "",
        ]
    if deepseek:
        lines += [
            DEEPSEEK_HEADING,
            "",
            f"Beside each of Megatron-Core's published DeepSeek-V3 runs ({deepseek_v3_fit.SOURCE}: "
            "sequences of 4096, micro-batches of one sequence, token-dropless with the tokens "
            "forced to balance), the planner's best mapping on the same system's profile at "
            "the same global batch, as above (schedules, memory walk), with "
            f"`model.fp8 {deepseek_v3_fit.FP8}` (the cost of current-scaling FP8, and of "
            "MXFP8, whose block scales Blackwell's tensor cores apply inside the product) "
            "and capacity factor 1.0. Each estimate takes about ten minutes here, so a few "
            "mappings are estimated, not searched: Megatron-Core's tensor and expert-parallel "
            "degrees, and on the B200s one expert a device; whole experts, the all-to-all "
            "dispatcher, no pipeline (a pipelined DeepSeek-V3 is traced whole, hours a "
            "mapping here; so Megatron-Core's own mappings are not estimated); micro-batches "
            "of one sequence, ZeRO-3 (the planner bounds ZeRO-1 at 589 GB a device on the "
            "B200s), full-layer recomputation. TFLOP/s per GPU are model FLOPs "
            "(MLA and MTP included) over the step; MFU is over the profile's 16-bit peak "
            "(B200: 2250, H100: 989.5 TFLOP/s dense), as Megatron-Core's TFLOP/s would be "
            "read against it (experiments/deepseek_v3_fit.py).",
            "",
            *deepseek_v3_fit.rows(deepseek),
            "",
        ]
    if store.cpu is None and earlier is not None:
        lines += kept_section(earlier, CPU_HEADING, "\n## ", "--parts")
    if store.cpu is not None:
        measured, repeats = store.cpu["rows"], store.cpu["repeats"]
        lines += [
            CPU_HEADING,
            "",
            "A small model (4 MoE layers of 8 experts, top 2; width 128; 32 positions; 32 "
            f"sequences per step; float32), XLA:CPU. Memory: XLA's compiled peak "
            "(arguments, outputs not aliased to the donated state, temporaries) beside the "
            "memory walk; step time over "
            f"{repeats} steps after 2 untimed ones, on a machine shared with other work. "
            f"Measured with jax {measured[0]['jax']}. From jax 0.11.2 XLA:CPU keeps the "
            "barriers in front of a recomputation until it has scheduled the step, as XLA:GPU "
            "does (up to jax 0.10.2 it dropped them before CSE, and its memory did not fall: "
            "the walk with the barriers dropped says what it held then); it runs the "
            "forward passes of the microbatches in flight (every one, below six) first. The walk "
            "follows a pipeline's ticks in their "
            "order; XLA:CPU holds more (it runs forward slots before the previous tick's "
            "backward slot, which nothing orders after them; tests/plan/test_memory.py "
            "bounds it by the walk with every forward slot a stage's chunks of ticks early).",
            "",
            *cpu_rows(measured),
            "",
        ]
    lines += [LEFT_OUT_HEADING, "", *(f"- {line}" for line in LEFT_OUT), ""]
    return "\n".join(lines)


PARTS = ("planner", "estimate", "exposed", "recipes", "long", "deepseek", "cpu")


def estimate_again(search: Search, command: str) -> Search:
    """``search`` with its best mapping estimated by the planner as it is now (part
    estimate), made by ``command``. The search is not run again: a mapping it left out may
    now be estimated faster."""
    from jaxmoe.plan.estimates import EstimateCache
    from jaxmoe.plan.mappings import with_mapping
    from jaxmoe.plan.model_flops import model_flops
    from jaxmoe.plan.planner import MappingEstimate
    from jaxmoe.plan.tracer import estimate_mapping
    from scheduling import PROFILES

    assert search.best is not None
    device = PROFILES[search.profile]
    config = planned_config(search.model, search.devices, search.batch)
    mapping = search.best.mapping
    mapped = with_mapping(config, mapping, device.devices_per_node)
    memory, times = estimate_mapping(mapped, SCHEDULES, search.profile, EstimateCache(None))
    best = MappingEstimate.priced(
        mapping,
        memory,
        times,
        model_flops(config).train_step(),
        device.peak_flops_per_s(config.model.dtype),
        device.memory_capacity_bytes,
    )
    return dataclasses.replace(search, best=best, estimate_command=command)


def break_down(search: Search, command: str) -> Search:
    """``search`` with its best mapping's communication by purpose (part exposed), made by
    ``command``."""
    from jaxmoe.plan.mappings import with_mapping
    from scheduling import PROFILES

    assert search.best is not None
    config = planned_config(search.model, search.devices, search.batch)
    mapped = with_mapping(config, search.best.mapping, PROFILES[search.profile].devices_per_node)
    exposed = exposed_communication(mapped, search.best.schedule, search.profile)
    return dataclasses.replace(search, exposed=exposed, exposed_command=command)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--devices",
        default=f"64,128,256,{RECIPE}",
        help=f"the searches: devices at one sequence each, or {RECIPE} (the recipe's "
        "devices and global batch); part deepseek: the published runs on these devices "
        f"({RECIPE}: all)",
    )
    parser.add_argument("--parts", default=",".join(PARTS), help="what to run again")
    parser.add_argument("--top", type=int, default=10, help="the best mappings made sure of")
    parser.add_argument(
        "--time-limit", type=float, help="seconds a search may take (its best then not proven)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per CPU option")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale_eval.md")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    entries = [n for n in args.devices.split(",") if n]
    if not all(n == RECIPE or n.isdigit() for n in entries):
        parser.error(f"--devices {args.devices!r}: device counts or {RECIPE}, comma-separated")
    parts = [p for p in args.parts.split(",") if p]
    if not parts or any(p not in PARTS for p in parts):
        parser.error(f"--parts {args.parts!r}: choose from {', '.join(PARTS)}")
    if args.top < 1 or args.repeats < 1:
        parser.error("--top and --repeats: at least 1")
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error(f"--time-limit {args.time_limit}: a number of seconds > 0")
    if not args.out.parent.is_dir():
        parser.error(f"--out: {args.out.parent} is not a directory")
    searches = searches_of(models, entries) if "planner" in parts else []
    for model, devices, batch in searches:  # every input checked before the first trace
        planned_config(model, devices, batch)
    command = command_line("experiments.scale_eval", sys.argv[1:] if argv is None else argv)
    stored = args.out.with_suffix(".json")
    tree = source_tree()  # what this run's code is

    def write(add: Callable[[Store], None]) -> None:
        """Add what this run made to the store as it is now (other runs may be adding
        theirs), and render the report from it."""
        store = Store.load(stored)
        add(store)
        store.trees[command] = f"at {tree}"
        store.save(stored)
        args.out.write_text(report(store, args.out))

    if "cpu" in parts:
        from experiments.shared.device_process import call_with_devices

        rows = call_with_devices(CPU_DEVICES, measure_options_on_cpu, args.repeats)
        cpu = {"command": command, "repeats": args.repeats, "rows": rows}
        write(lambda store: setattr(store, "cpu", cpu))
    for model, devices, batch in searches:
        search = plan_one(model, devices, batch, args.top, command, args.time_limit)
        write(lambda store, search=search: store.add_search(search))
    # The stored searches' best mappings (those --models and --devices name).
    asked = {(m, d, b, SEQ_LEN, PROFILE) for m, d, b in searches_of(models, entries)}
    if "estimate" in parts:
        for earlier in Store.load(stored).searches:
            if earlier.key in asked and earlier.best is not None and earlier.command != command:
                search = estimate_again(earlier, command)
                write(lambda store, search=search: store.add_search(search))
    if "exposed" in parts:
        for earlier in Store.load(stored).searches:
            if earlier.key in asked and earlier.best is not None:
                search = break_down(earlier, command)
                write(lambda store, search=search: store.add_search(search))
    if "long" in parts:
        for seq_len, devices in long_context.SETTINGS:
            batch = long_context.sequences(seq_len)
            search = plan_one(
                long_context.MODEL, devices, batch, args.top, command, args.time_limit, seq_len
            )
            write(lambda store, search=search: store.add_search(search))
    if "deepseek" in parts:
        runs = deepseek_v3_fit.PUBLISHED
        if RECIPE not in entries:  # the published runs on the devices asked for
            runs = tuple(run for run in runs if str(run.devices) in entries)
        for run in runs:
            search = plan_one(
                deepseek_v3_fit.MODEL, run.devices, run.global_batch, args.top, command,
                args.time_limit, profile=run.profile,
            )  # fmt: skip
            write(lambda store, search=search: store.add_search(search))
    if "recipes" in parts:
        for model in models:
            estimates = [
                estimate_in_fresh_process(model, PROFILE, row, mapping)
                for row, mapping in recipe_mappings(model)
            ]
            write(lambda store, m=model, e=estimates: store.add_recipes(m, command, e))


if __name__ == "__main__":
    main()
