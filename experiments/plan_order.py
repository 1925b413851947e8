"""In which order the planner estimates mappings: how soon it finds the best, against another tree.

    python -m experiments.plan_order --against DIR [--preset small --devices 64]

``jaxmoe plan`` of the preset on ``--devices`` devices of ``--profile``, searched to the end
(no time limit, nothing cached, ``--jobs`` worker processes), once with this tree and once
with the tree at DIR, each in a fresh process with that tree first on ``sys.path``. Each
progress line that reports an estimate is stamped with the wall seconds since the plan
began. Both searches prove the same best mappings (the table says whether their ``--top``
agree); what differs is the order in which they estimate, so the results give, for a few
times, how many of those best each search had estimated by then and the least step among
them: what a plan with that ``--time-limit`` would have found (at least: a limited search
also finishes the batch it began before its limit). Then this tree plans once more with
``--time-limit`` ``--limit``, as a user would for an interactive plan, and so does the
other tree: their times, their best, and how many of their best are the proven best.

Writes ``experiments/results/plan_order.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

from experiments.shared.other_tree import commit_of, naming_dir, run_in_tree
from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results" / "plan_order.md"
ROOT = Path(__file__).resolve().parent.parent
# Wall seconds at which the results say what each search had found.
TIMES = (60.0, 120.0, 300.0, 600.0)


def _search(
    preset: str, devices: int, profile: str, jobs: int, top: int, time_limit: float | None
) -> dict:
    """One plan, its estimates stamped with the wall seconds since it began (sent to the
    other tree as source: it reads nothing of this module)."""
    import resource
    import time

    from jaxmoe.cli import parser as cli
    from jaxmoe.plan.planner import plan_mappings

    config = cli.resolve_config(
        cli.parse(["plan", "--preset", preset, "--devices", str(devices), "--profile", profile])
    )
    began, cpu = time.monotonic(), time.process_time()
    estimated = []
    tightened = []  # the wall seconds of each mapping's trace of its own (a tighter bound)

    def progress(line: str) -> None:
        if line.startswith("estimated "):
            label = line[len("estimated ") :].rsplit(": ", 1)[0]
            estimated.append([time.monotonic() - began, label])
        elif line.startswith("bounds of "):
            tightened.append(time.monotonic() - began)

    result = plan_mappings(
        config, preset, devices, profile, top=top, jobs=jobs, time_limit=time_limit,
        progress=progress,
    )  # fmt: skip
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "wall": time.monotonic() - began,
        "cpu": time.process_time() - cpu + children.ru_utime + children.ru_stime,
        "estimated": estimated,
        "tightened": tightened,
        "complete": result.complete,
        "ranked": [[e.mapping.label(), e.best.step, e.schedule] for e in result.ranked[:top]],
    }


def _run(tree: Path, preset: str, devices: int, profile: str, jobs: int, top: int,
         time_limit: float | None) -> dict:  # fmt: skip
    """:func:`_search` in a fresh process that imports ``tree``'s jaxmoe and scheduling."""
    return run_in_tree(tree, _search, (preset, devices, profile, jobs, top, time_limit))


def _found_by(search: dict, best: dict[str, float], seconds: float) -> tuple[int, float | None]:
    """Of the proven ``best`` (label -> step), how many ``search`` had estimated by
    ``seconds``, and the least step among them (None: none)."""
    labels = {label for stamp, label in search["estimated"] if stamp <= seconds}
    steps = [step for label, step in best.items() if label in labels]
    return len(steps), min(steps, default=None)


def _first(search: dict, labels: set[str]) -> float | None:
    """The wall seconds by which ``search`` had estimated every one of ``labels``."""
    stamps = {label: stamp for stamp, label in search["estimated"] if label in labels}
    return max(stamps.values()) if len(stamps) == len(labels) else None


def report(
    this: dict, other: dict, limited: list[dict], commits: tuple[str, str], argv: list[str],
    preset: str, devices: int, profile: str, limit: float,
) -> str:  # fmt: skip
    best = {label: step for label, step, _ in this["ranked"]}
    top = len(best)
    agree = [label for label, _, _ in this["ranked"]] == [label for label, _, _ in other["ranked"]]
    first_label = this["ranked"][0][0]

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.3f}"

    def at(seconds: float | None) -> str:
        return "not within the search" if seconds is None else f"{seconds:.0f} s"

    lines = [
        "# The planner's order of estimates: how soon it finds the best mappings",
        "",
        f"Command: `{command_line('experiments.plan_order', naming_dir(argv))}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores.",
        "",
        f"This tree: {commits[0]}. The other: {commits[1]}.",
        "",
        f"`jaxmoe plan --preset {preset} --devices {devices} --profile {profile}`, searched "
        "to the end with nothing cached; wall and CPU seconds of the whole plan (its worker "
        "processes included).",
        "",
        "| tree | wall s | CPU s | mappings estimated | mappings traced on their own "
        "(tighter bounds) | of them before the first estimate | first estimate s | "
        "best step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, search in (("this", this), ("other", other)):
        first = min((stamp for stamp, _ in search["estimated"]), default=None)
        before = sum(1 for stamp in search["tightened"] if first is None or stamp < first)
        lines.append(
            f"| {name} | {search['wall']:.0f} | {search['cpu']:.0f} | "
            f"{len(search['estimated'])} | {len(search['tightened'])} | {before} | "
            f"{'-' if first is None else f'{first:.0f}'} | {ms(search['ranked'][0][1])} |"
        )
    lines += [
        "",
        f"The same {top} best, in the same order: {'yes' if agree else 'no'}.",
        "",
        f"## What each search had found by a time (of its {top} best)",
        "",
        "| seconds | this: of the best | this: least step ms | other: of the best | "
        "other: least step ms |",
        "|---|---|---|---|---|",
    ]
    for seconds in TIMES:
        counts = [_found_by(search, best, seconds) for search in (this, other)]
        lines.append(
            f"| {seconds:.0f} | {counts[0][0]} | {ms(counts[0][1])} | {counts[1][0]} | "
            f"{ms(counts[1][1])} |"
        )
    lines += [
        "",
        f"- The best ({first_label}, {ms(best[first_label])} ms): estimated at "
        f"{at(_first(this, {first_label}))} by this tree, {at(_first(other, {first_label}))} by "
        "the other.",
        f"- All {top} best: by {at(_first(this, set(best)))} and {at(_first(other, set(best)))}.",
        "",
        f"## With `--time-limit {limit:g}`",
        "",
        "| tree | wall s | CPU s | mappings estimated | its best | step ms | of its best, "
        f"among the proven {top} best |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, search in zip(("this", "other"), limited, strict=True):
        found = [label for label, _, _ in search["ranked"]]
        head = (
            f"{found[0]}{' (the proven best)' if found[0] == first_label else ''} | "
            f"{ms(search['ranked'][0][1])}"
            if found
            else "none | -"
        )
        lines.append(
            f"| {name} | {search['wall']:.0f} | {search['cpu']:.0f} | "
            f"{len(search['estimated'])} | {head} | "
            f"{sum(1 for label in found if label in best)} of {len(found)} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, help="another checkout's root")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--profile", default="a100-8x-nvlink-400g")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8))
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--limit", type=float, default=60.0, help="the interactive plan's")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    plan = (args.preset, args.devices, args.profile, args.jobs, args.top)
    this = _run(ROOT, *plan, None)
    print(f"this tree: {this['wall']:.0f} s, {len(this['estimated'])} estimated")
    other = _run(args.against, *plan, None)
    print(f"other tree: {other['wall']:.0f} s, {len(other['estimated'])} estimated")
    limited = {tree: _run(tree, *plan, args.limit) for tree in (ROOT, args.against)}
    commits = (commit_of(ROOT), commit_of(args.against))
    where = (args.preset, args.devices, args.profile, args.limit)
    args.out.write_text(
        report(this, other, [limited[ROOT], limited[args.against]], commits, argv, *where)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
