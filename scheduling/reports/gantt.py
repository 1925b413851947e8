"""Draw a simulated timeline as a Gantt chart (PNG).

It reads the Chrome trace of :mod:`scheduling.reports.chrome_trace`, so a chart can be drawn
from a saved ``schedule_timeline.json`` as well as from a fresh report. One
row per stream. Compute is coloured by phase, and the compute stream's waits
on collectives are red. Collectives are coloured by kind. Needs matplotlib
(the ``plots`` extra); it is imported only here.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

PHASE_COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2"}
WAIT_COLOUR = "#c44e52"
COLLECTIVE_COLOURS = {"all_to_all": "#dd8452", "psum": "#937860", "psum_invariant": "#937860"}
OTHER_COLOUR = "#8c8c8c"


def _colour(event: dict[str, Any], stream: str) -> str:
    if event.get("cat") == "wait":
        return WAIT_COLOUR
    if stream == "communication":
        kind = event["name"].split("@", 1)[0]
        return COLLECTIVE_COLOURS.get(kind, OTHER_COLOUR)
    return PHASE_COLOURS.get(event.get("cat", ""), OTHER_COLOUR)


def available() -> bool:
    """Whether matplotlib is installed (``pip install 'jaxmoe[plots]'``)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def gantt_png(trace: dict[str, Any], path: str | Path, title: str = "") -> None:
    """Write the trace's two streams as a Gantt chart to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    streams = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    end = 0.0
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        stream = streams[event["tid"]]
        start_ms, length_ms = event["ts"] / 1e3, event["dur"] / 1e3
        bars[event["tid"], _colour(event, stream)].append((start_ms, length_ms))
        end = max(end, start_ms + length_ms)

    rows = sorted(streams)
    figure, axes = plt.subplots(figsize=(12, 1.2 + 0.8 * len(rows)))
    for (tid, colour), spans in bars.items():
        row = rows.index(tid)
        axes.broken_barh(spans, (row - 0.4, 0.8), facecolors=colour, linewidth=0)
    axes.set_yticks(range(len(rows)), [streams[tid] for tid in rows])
    axes.invert_yaxis()
    axes.set_xlim(0, end * 1.01 if end else 1)
    axes.set_xlabel("ms (cost model)")
    axes.set_title(title or trace["traceEvents"][0]["args"]["name"])
    legend = [Patch(color=c, label=p) for p, c in PHASE_COLOURS.items()]
    legend += [Patch(color=WAIT_COLOUR, label="waiting on a collective")]
    legend += [Patch(color=COLLECTIVE_COLOURS["all_to_all"], label="all_to_all")]
    legend += [Patch(color=COLLECTIVE_COLOURS["psum"], label="psum")]
    axes.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=6)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
