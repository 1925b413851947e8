"""The simulated timeline exported as a Chrome trace agrees with the simulation."""

import itertools
import json

import pytest

from scheduling.costs.cost_model import CostModel
from scheduling.costs.simulate import simulate
from scheduling.order.list_scheduler import order
from scheduling.passes import Placement, schedule_dw, split_async
from scheduling.profiles import PROFILES
from scheduling.program.graph import Graph
from scheduling.reports.chrome_trace import chrome_trace
from scheduling.search.step_estimate import node_seconds
from tests.scheduling.toys import toy_program


def _timeline(policy: str):
    program = toy_program()
    seconds = node_seconds(CostModel(PROFILES["cpu"], dict(program.mesh.shape)))
    if policy == "none":
        graph = Graph(program, split=lambda op: False)
        return graph, simulate(graph, list(range(len(graph.nodes))), seconds)
    graph = split_async(program)
    ordered = order(graph, schedule_dw(graph, seconds) if policy == "dw" else Placement())
    return graph, simulate(graph, ordered.nodes, seconds)


def _intervals(trace, tid):
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]
    return sorted(spans, key=lambda e: e["ts"])


@pytest.mark.parametrize("policy", ["none", "async", "dw"])
def test_trace_tracks_match_the_simulated_timeline(policy):
    graph, timeline = _timeline(policy)
    trace = json.loads(json.dumps(chrome_trace(graph, timeline)))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"compute", "communication"}
    for tid in (0, 1):
        spans = _intervals(trace, tid)
        for earlier, later in itertools.pairwise(spans):
            assert earlier["ts"] + earlier["dur"] <= later["ts"] + 1e-6  # one thing at a time
    compute = _intervals(trace, 0)
    busy = sum(e["dur"] for e in compute if e["cat"] != "wait")
    waits = sum(e["dur"] for e in compute if e["cat"] == "wait")
    assert busy == pytest.approx(timeline.compute_seconds * 1e6)
    assert waits == pytest.approx(timeline.exposed_communication_seconds * 1e6)
    communication = sum(e["dur"] for e in _intervals(trace, 1))
    assert communication == pytest.approx(timeline.communication_seconds * 1e6)
    assert max(e["ts"] + e["dur"] for e in compute) == pytest.approx(timeline.step_seconds * 1e6)


def test_synchronous_collectives_are_waits_on_the_compute_stream():
    graph, timeline = _timeline("none")
    trace = chrome_trace(graph, timeline)
    waits = [e for e in _intervals(trace, 0) if e["cat"] == "wait"]
    assert waits and all(e["name"].startswith("wait ") for e in waits)
    assert sum(e["dur"] for e in waits) == pytest.approx(timeline.communication_seconds * 1e6)


def test_gantt_chart_draws_both_streams_and_the_waits(tmp_path):
    import matplotlib.image

    from scheduling.reports.gantt import COLLECTIVE_COLOURS, WAIT_COLOUR, gantt_png

    def span(tid, name, cat, ts, dur):
        return {"ph": "X", "pid": 0, "tid": tid, "name": name, "cat": cat, "ts": ts, "dur": dur}

    def trace(*spans):
        streams = [
            {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}
            for tid, name in ((0, "compute"), (1, "communication"))
        ]
        process = {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "toy"}}
        return {"traceEvents": [process, *streams, *spans]}

    def pixels_of(colour: str, document) -> int:
        path = tmp_path / "timeline.png"
        gantt_png(document, path)
        pixels = matplotlib.image.imread(path)[..., :3]
        rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        return int((abs(pixels - rgb).max(axis=-1) < 0.02).sum())

    compute = span(0, "dot_general@layer_0", "forward", 0, 400)
    exchange = span(1, "all_to_all@layer_0", "forward", 400, 300)
    wait = span(0, "wait all_to_all@layer_0", "wait", 400, 300)
    after = span(0, "dot_general@layer_0", "backward", 700, 300)
    # The legend shows every colour once; a bar adds many more pixels of its colour.
    legend_only = pixels_of(WAIT_COLOUR, trace(compute, exchange, after))
    assert pixels_of(WAIT_COLOUR, trace(compute, exchange, wait, after)) > 10 * legend_only
    legend_only = pixels_of(COLLECTIVE_COLOURS["all_to_all"], trace(compute, wait, after))
    with_bar = pixels_of(COLLECTIVE_COLOURS["all_to_all"], trace(compute, exchange, wait, after))
    assert with_bar > 10 * legend_only
