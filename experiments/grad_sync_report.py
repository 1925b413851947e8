"""Tables and plot of ``experiments.grad_sync_eval``'s runs: one table per link speed."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

from jaxmoe.parallel.grad_sync import EXACT


def _smoothed(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def target_loss(result: dict) -> float:
    """The smoothed loss ``allreduce`` reaches after ``target_fraction`` of the steps
    (median over its runs)."""
    step = max(0, round(result["target_fraction"] * result["steps"]) - 1)
    window = result["smoothing"]
    losses = [
        _smoothed(run["loss"], window)[step]
        for run in result["runs"]
        if run["algorithm"] == "allreduce"
    ]
    return statistics.median(losses)


def _step_times(run: dict) -> list[float]:
    """The run's step times, the first replaced by the median: the first call of a program
    also opens its collectives' connections, a cost paid once per process, not per step."""
    return [statistics.median(run["step_s"]), *run["step_s"][1:]]


def _time_to_target(run: dict, target: float, window: int) -> float | None:
    elapsed = 0.0
    for seconds, loss in zip(_step_times(run), _smoothed(run["loss"], window), strict=True):
        elapsed += seconds
        if loss <= target:
            return elapsed
    return None


def summarise(result: dict) -> dict[str, dict[str, dict]]:
    """``link -> algorithm -> figures`` (medians over repeats, with their spread)."""
    target, window, warmup = target_loss(result), result["smoothing"], result["warmup"]
    hosts = result["hosts"]
    table: dict[str, dict[str, dict]] = {}
    key = lambda run: (f"{run['link_mbit']:g}", run["algorithm"])
    for (link, algorithm), group in itertools.groupby(sorted(result["runs"], key=key), key):
        runs = list(group)
        steps = [statistics.median(run["step_s"][warmup:]) for run in runs]
        reached = [_time_to_target(run, target, window) for run in runs]
        table.setdefault(link, {})[algorithm] = {
            "step_s": statistics.median(steps),
            "step_spread_s": (min(steps), max(steps)),
            "mb_per_step": statistics.median(
                run["link_bytes"] / len(run["loss"]) / hosts / 1e6 for run in runs
            ),
            "loss_after_n": statistics.median(statistics.fmean(run["loss"][-3:]) for run in runs),
            "time_to_target_s": None if None in reached else statistics.median(reached),
            "time_spread_s": None if None in reached else (min(reached), max(reached)),
            "repeats": len(runs),
        }
    return table


def _winner(rows: dict[str, dict]) -> str | None:
    reached = {a: r["time_to_target_s"] for a, r in rows.items() if r["time_to_target_s"]}
    return min(reached, key=reached.get) if reached else None


def within_spread(rows: dict[str, dict], winner: str | None) -> list[str]:
    """The other algorithms whose time to the target, over their repeats, overlaps the
    winner's (min-max): the measurement does not tell them apart."""
    if winner is None:
        return []
    low, high = rows[winner]["time_spread_s"]
    return [
        name
        for name, row in rows.items()
        if name != winner
        and row["time_spread_s"] is not None
        and row["time_spread_s"][0] <= high
        and row["time_spread_s"][1] >= low
    ]


def auto_verdict(rows: dict[str, dict], winner: str | None, chosen: str | None) -> str:
    """Whether ``chosen`` is the measured winner, in words, saying which algorithms the
    measurement's spread does not tell apart from the winner."""
    close = within_spread(rows, winner)
    if chosen == winner:
        text = "agrees with the measurement"
        if close:
            text += f" ({', '.join(close)} within the spread of the winner's time)"
        return text
    if chosen in close:
        return f"differs from the measured winner, but {chosen} is within the spread of its time"
    return "differs from the measurement"


def _seconds(value: float | None, spread: tuple | None = None) -> str:
    if value is None:
        return "not reached"
    text = f"{value:.1f}"
    return text + (f" ({spread[0]:.1f}-{spread[1]:.1f})" if spread else "")


def format_markdown(result: dict, table: dict[str, dict[str, dict]]) -> str:
    target = target_loss(result)
    config = result["config"]
    lines = [
        "# Gradient synchronisation: every algorithm at several link speeds",
        "",
        f"Command: `{result['command']}`",
        "",
        *([f"**Note.** {result['note']}", ""] if result.get("note") else []),
        "Instrument 1 (emulated cluster): "
        f"{result['hosts']} hosts x {result['devices_per_host']} fake CPU devices "
        f"({result['machine']}), layout data {config['parallel']['data']} x expert "
        f"{config['parallel']['expert']} (expert groups inside a host: the link carries the "
        "data-parallel gradient synchronisation), preset tiny, batch "
        f"{config['train']['batch_size']}, {result['steps']} steps per run, links shaped with "
        "`tc tbf`.",
        "Link calibration (`experiments.emulation.link_calibration`, run before each link's "
        "measurements): "
        + "; ".join(
            f"{link} Mbit/s: a {c['message_bytes'] / 2**20:.2f} MiB message at "
            f"{c['rate_fraction']:.1%} of the rate, 8 pieces {c['pieces_ratio']:.3f}x one "
            f"message, {'calibrated' if c['passed'] else 'NOT CALIBRATED'}"
            for link, c in result["link_calibration"].items()
        )
        + ".",
        "",
        "- **step**: median step time after the first "
        f"{result['warmup']} steps, median over repeats (spread: min-max of the repeats);",
        "- **MB/step**: bytes each host sent over its link per step (its interface counter "
        "around the run, compilation and the final validation pass included, over the "
        "steps: a slight upper bound);",
        f"- **loss after N**: mean loss of the last 3 of the {result['steps']} steps;",
        "- **time to target**: summed step times (the first step, which also opens the "
        "collectives' connections, counted as a median step) until the loss (mean of the last "
        f"{result['smoothing']} steps) first reaches {target:.3f}, the loss allreduce reaches "
        f"after {result['target_fraction']:.0%} of the steps;",
        "- **auto**: what `--train.grad_sync auto` picks when told the link speed "
        "(profile cpu at that link, as a profile file), and its estimated step;",
        "- **auto with a trial**: what it picks when it also times the algorithms whose "
        "estimates lie within the margin of the best (`--train.grad_sync_trial_steps`), run "
        "on the hosts of that link (`jaxmoe train`), where there is one.",
        "",
    ]
    slowest = min(table, key=float)
    for link in sorted(table, key=float):
        rows = table[link]
        winner = _winner(rows)
        choice = result["auto"].get(link, {})
        estimated = {e["name"]: e["step_seconds"] for e in choice.get("estimates", [])}
        reference = rows.get("allreduce", {}).get("time_to_target_s")
        lines += [
            f"## {link} Mbit/s",
            "",
            "| algorithm | exact | step (ms) | MB/step | loss after N | time to target (s) "
            "| vs allreduce | auto's estimate (ms) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for algorithm, r in rows.items():
            low, high = r["step_spread_s"]
            mark = " **winner**" if algorithm == winner else ""
            mark += " (auto)" if algorithm == choice.get("chosen") else ""
            ratio = (
                f"{reference / r['time_to_target_s']:.2f}x"
                if reference and r["time_to_target_s"]
                else "-"
            )
            lines.append(
                f"| {algorithm}{mark} | {'yes' if algorithm in EXACT else 'no'} "
                f"| {r['step_s'] * 1e3:.0f} ({low * 1e3:.0f}-{high * 1e3:.0f}) "
                f"| {r['mb_per_step']:.2f} | {r['loss_after_n']:.3f} "
                f"| {_seconds(r['time_to_target_s'], r['time_spread_s'])} | {ratio} "
                f"| {estimated.get(algorithm, float('nan')) * 1e3:.0f} |"
            )
        lines += [
            "",
            f"Winner: {winner or 'none reached the target'}; auto chose "
            f"{choice.get('chosen')} ({choice.get('reason')}), which "
            f"{auto_verdict(rows, winner, choice.get('chosen'))}.",
            "",
        ]
        trial = result.get("auto_trial", {}).get(link)
        if trial:
            tried = ", ".join(
                f"{e['name']} {e['measured_step_seconds'] * 1e3:.0f} ms"
                for e in trial["estimates"]
                if e.get("measured_step_seconds") is not None
            )
            lines += [
                f"auto with a trial chose {trial['chosen']} ({trial['reason']}; measured steps: "
                f"{tried}), which {auto_verdict(rows, winner, trial['chosen'])}.",
                "",
            ]
    rows = table[slowest]
    relaxed = {a: r for a, r in rows.items() if a not in EXACT and r["time_to_target_s"]}
    reference = rows.get("allreduce", {}).get("time_to_target_s")
    lines += ["## Target", ""]
    if relaxed and reference:
        best = min(relaxed, key=lambda a: relaxed[a]["time_to_target_s"])
        speedup = reference / relaxed[best]["time_to_target_s"]
        verdict = "met" if speedup >= 1.5 else "not met"
        lines.append(
            f"At {slowest} Mbit/s the best relaxed algorithm, {best}, reaches the target loss "
            f"in {relaxed[best]['time_to_target_s']:.1f} s against allreduce's "
            f"{reference:.1f} s: {speedup:.2f}x (target: 1.5x; {verdict})."
        )
    else:
        lines.append(f"At {slowest} Mbit/s no relaxed algorithm (or allreduce) reached the target.")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target, window = target_loss(result), result["smoothing"]
    links = sorted({f"{run['link_mbit']:g}" for run in result["runs"]}, key=float)
    figure, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        for run in result["runs"]:
            if f"{run['link_mbit']:g}" != link or run["repeat"] != 0:
                continue
            elapsed = list(itertools.accumulate(_step_times(run)))
            style = "-" if run["algorithm"] in EXACT else "--"
            ax.plot(elapsed, _smoothed(run["loss"], window), style, label=run["algorithm"])
        ax.axhline(target, color="grey", linewidth=0.8)
        ax.set_title(f"{link} Mbit/s")
        ax.set_xlabel("training time (s, summed step times)")
        ax.set_ylabel(f"loss (mean of {window} steps)")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(result: dict, out: Path | None) -> str:
    """The markdown text; with ``out``, also ``out`` and its ``.json`` and ``.png``."""
    text = format_markdown(result, summarise(result))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out.with_suffix(".png"))
        text = text.replace(
            "# Gradient", f"![loss against time]({out.with_suffix('.png').name})\n\n# Gradient", 1
        )
        out.write_text(text)
    return text
