"""The table of ``jaxmoe plan``: the ranked mappings with every column, then what was
dropped for memory and what was skipped, and why."""

from __future__ import annotations

from jaxmoe.plan.layer_extrapolation import DEPTH_METHOD
from jaxmoe.plan.planner import MEMORY_METHOD, MappingEstimate, NotEstimated, PlanResult
from jaxmoe.plan.search import most_over_least


def table(result: PlanResult, verbose: bool = False) -> str:
    """The ranked mappings, every column, and what was dropped or skipped."""
    largest = max((e.peak_bytes for e in result.estimates), default=0)
    unit, scale, exponent = ("GB", 1e9, 9) if largest >= 1e9 else ("MB", 1e6, 6)
    width = max([9] + [len(e.mapping.attention_label) for e in result.estimates])
    header = (
        f"{'#':>3}  {'attention':>{width}}  {'MoE':>8}  {'dispatcher':<10}  {'ZeRO':>4}  "
        f"{'recompute':<9}  {'mb':>3}  {'schedule':<8}  {'step ms':>9}  {'MFU %':>6}  "
        f"{'compute':>8}  {'comm':>8}  {'exposed':>8}  {'master':>7}  {'optim':>7}  "
        f"{'params':>7}  {'activ':>7}  {'bwd':>7}  {'total ' + unit:>8}"
    )
    capacity = result.profile.memory_capacity_bytes
    lines = [
        f"jaxmoe plan: {result.preset!r} on {result.devices} devices of profile "
        f"{result.profile.name!r} ({result.peak_flops_per_s / 1e12:g} TFLOP/s peak, "
        + (f"{capacity / 1e9:g} GB per device" if capacity else "no memory figure")
        + f"); {result.model_flops_per_step / 1e12:.4g} TFLOP of model FLOPs per step; "
        f"schedules {', '.join(result.schedules)}",
        "attention = data x tensor (or data x context x tensor, ring or all-gathered keys "
        "and values); MoE = expert data x expert x expert tensor; ZeRO stage, "
        "recomputation and microbatches (mb); times in ms; memory per device at the step's "
        f"peak in {unit} (1e{exponent} bytes; --verbose says what each column holds)"
        + (f"; the model's depth {DEPTH_METHOD}" if result.extrapolated else ""),
        header,
        "-" * len(header),
    ]

    def size(size: int) -> str:
        return f"{size / scale:.3f}"

    def row(rank: str, e: MappingEstimate) -> str:
        m, t, mem = e.mapping, e.best, e.memory
        return (
            f"{rank:>3}  {m.attention_label:>{width}}  "
            f"{f'{m.expert_data}x{m.expert}x{m.expert_tensor}':>8}  {m.dispatcher:<10}  "
            f"{m.zero:>4}  {m.recompute:<9}  {m.microbatches:>3}  "
            f"{e.schedule:<8}  {t.step * 1e3:>9.3f}  {e.mfu * 100:>6.3g}  "
            f"{t.compute * 1e3:>8.3f}  {t.communication * 1e3:>8.3f}  "
            f"{t.exposed_communication * 1e3:>8.3f}  {size(mem.master):>7}  "
            f"{size(mem.optimizer):>7}  {size(mem.parameters + t.prefetched):>7}  "
            f"{size(mem.activations):>7}  {size(mem.backward + mem.pipeline):>7}  "
            f"{size(e.peak_bytes):>8}"
        )

    lines += [row(str(i + 1), e) for i, e in enumerate(result.ranked)]
    if not result.ranked:
        lines.append("  (no mapping fits in the device memory)")
    over = result.over_memory
    if over:
        smallest = min(e.peak_bytes for e in over)
        lines.append(
            f"dropped {len(over)} mappings over {capacity / 1e9:g} GB per device (the "
            f"smallest of them needs {smallest / 1e9:.3f} GB)"
        )
        if verbose:
            lines += [row("-", e) for e in over]
    skipped = result.space.skipped
    left = result.not_estimated
    unreached = [item for item in result.not_estimated if item.kind == "time"]
    if not result.complete:
        lines.append(
            f"the search stopped at its time limit: the ranking is of the mappings estimated; "
            f"{len(unreached)} mappings whose bounds are under the best were not estimated"
            + _certified(result)
        )
    lines.append(
        f"{len(result.estimates)} mappings estimated"
        + (_proven(result) if result.top and result.complete else "")
        + f", {len(left)} not estimated, {len(skipped)} layouts skipped"
        + (":" if verbose and (skipped or left) else " (--verbose says why)")
    )
    if verbose:
        lines += [f"  {line}" for line in result.space.skipped_summary()]
        lines += [f"  {line}" for line in not_estimated_summary(left)]
        lines.append(f"memory: {MEMORY_METHOD}")
    return "\n".join(lines)


def _certified(result: PlanResult) -> str:
    """What a search cut short still proves of its best: no mapping left is faster than
    the least bound left, so the best found takes at most that much longer than the best
    of all (nothing longer where, ``--top`` above 1, every bound left is over the best)."""
    least = result.least_bound_left
    if not result.ranked or least is None:
        return ""
    best = result.ranked[0].best.step
    return (
        f" (none is faster than {least * 1e3:.3f} ms: the best found takes at most "
        f"{most_over_least(best, least):.0%} longer than the best of all)"
    )


def _proven(result: PlanResult) -> str:
    """What the search made sure of, where it was not cut short."""
    if not result.gap:
        return f" (the {result.top} best that fit are exact)"
    return (
        f" (none left can be more than {result.gap:.0%} faster than the slowest of the "
        f"{result.top} best that fit)"
    )


def not_estimated_summary(left: tuple[NotEstimated, ...]) -> list[str]:
    """One line per kind of reason a mapping was not estimated: how many, and one of them."""
    by_kind: dict[str, list[NotEstimated]] = {}
    for item in left:
        by_kind.setdefault(item.kind, []).append(item)
    lines = []
    for items in sorted(by_kind.values(), key=len, reverse=True):
        example = items[0]
        lines.append(f"{len(items)} x {example.reason} (e.g. {example.mapping.label()})")
    return lines
