"""Export a simulated timeline as a Chrome trace (JSON), to open in Perfetto's UI.

Two tracks: the compute stream (every op, and the waits on collectives, named
``wait <collective>``) and the communication stream (every collective). Times
are the cost model's estimates, in microseconds. Ops that cost nothing (views,
reshapes) are left out to keep traces readable.
"""

from __future__ import annotations

from typing import Any

from scheduling.costs.simulate import Timeline
from scheduling.program.graph import Graph

_STREAMS = {"compute": 0, "communication": 1}


def chrome_trace(graph: Graph, timeline: Timeline, name: str = "schedule") -> dict[str, Any]:
    """The timeline as a Chrome trace-event document (``{"traceEvents": [...]}``)."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": name}},
        *(
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": stream}}
            for stream, tid in _STREAMS.items()
        ),
    ]
    for event in timeline.events:
        if event.seconds <= 0:
            continue
        op = graph.nodes[event.node].op
        label = f"{op.primitive}@{op.layer}" if op.layer else op.primitive
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": _STREAMS[event.stream],
                "name": f"wait {label}" if event.waiting else label,
                "cat": "wait" if event.waiting else op.phase.value,
                "ts": event.start * 1e6,
                "dur": event.seconds * 1e6,
                "args": {
                    "node": event.node,
                    "phase": op.phase.value,
                    "layer": op.layer,
                    # What scheduling.reports.measured_trace matches against XLA's op metadata.
                    "primitive": op.primitive,
                    "name_stack": op.name_stack,
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
