"""prefetch: a gather of sharded weights starts only as early as it takes to hide it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.costs.simulate import simulate
from scheduling.names import PARAMETER_GATHER_SCOPE
from scheduling.order.list_scheduler import order
from scheduling.passes import Placement, split_async
from scheduling.passes.prefetch import is_parameter_gather, prefetch_bounds
from scheduling.program.capture import capture
from scheduling.program.graph import Role
from tests.scheduling.toys import N, mesh_x, sds

LAYERS, WIDTH = 3, 8


def _sharded_layers(shards, x):
    """Three 'blocks', each gathering its weight shard right before it multiplies."""
    for layer, shard in enumerate(shards):
        with jax.named_scope(f"layer_{layer}"):
            with jax.named_scope(PARAMETER_GATHER_SCOPE):
                w = jax.lax.all_gather(shard, "x", tiled=True)
            for _ in range(4):
                x = jnp.tanh(x @ w)
    return x


def _graph():
    mesh = mesh_x()
    shards = tuple(sds(mesh, (WIDTH, WIDTH), P("x")) for _ in range(LAYERS))
    x = sds(mesh, (N * 2, WIDTH), P("x"))
    program = capture(
        _sharded_layers, shards, x, mesh=mesh, in_specs=((P("x"),) * LAYERS, P("x")),
        out_specs=P("x"),
    )  # fmt: skip
    return split_async(program)


def _seconds(gather: float):
    """Every compute op 1 s, a gather ``gather`` s."""

    def seconds(node):
        if node.role is Role.DONE:
            return 0.0
        return gather if node.op.primitive == "all_gather" else 1.0

    return seconds


def _starts(graph):
    return [node for node in graph.starts() if is_parameter_gather(node)]


@pytest.mark.parametrize("lead", [1.0, 2.0])
def test_each_gather_starts_where_the_compute_before_its_use_covers_lead_times_it(lead):
    graph = _graph()
    seconds = _seconds(gather=3.0)
    bounds = prefetch_bounds(graph, seconds, lead)
    starts = _starts(graph)
    assert len(starts) == LAYERS and set(bounds) == {s.id for s in starts}
    ordered = order(graph, Placement(), 0.1, None, bounds)
    position = {node: i for i, node in enumerate(ordered.nodes)}
    for start in starts:
        first_use, bound = min(graph.succs[start.partner]), bounds[start.id]
        computes = [
            n.id for n in graph.nodes[bound:first_use]
            if n.role is Role.COMPUTE and not n.is_collective
        ]  # fmt: skip
        covered = sum(seconds(graph.nodes[n]) for n in computes)
        if bound > 0:  # covers lead x the gather; one op less would not
            assert covered >= lead * 3.0 > covered - seconds(graph.nodes[bound])
        else:  # the first block: the step starts there
            assert start is starts[0]
        # The start runs before its first use and before none of the compute it hides behind.
        assert position[start.id] < position[first_use]
        assert all(position[start.id] < position[n] for n in computes)
    # Later blocks' gathers start after earlier blocks' compute.
    assert position[starts[-1].id] > position[min(graph.succs[starts[0].partner])]


def test_without_a_lead_every_gather_starts_with_the_step():
    graph = _graph()
    assert prefetch_bounds(graph, _seconds(gather=3.0), 0.0) == {}
    ordered = order(graph, Placement(), 0.1)
    position = {node: i for i, node in enumerate(ordered.nodes)}
    starts = sorted(position[s.id] for s in _starts(graph))
    assert starts == list(range(len(starts)))  # the first ops of the step
    bounded = order(graph, Placement(), 0.1, None, prefetch_bounds(graph, _seconds(3.0), 2.0))
    # Held for a shorter time: the prefetched order's live bytes peak no higher.
    assert bounded.peak_live_bytes <= ordered.peak_live_bytes
    later = sorted({node: i for i, node in enumerate(bounded.nodes)}[s.id] for s in _starts(graph))
    assert later[-1] > starts[-1] + 4 * (LAYERS - 1)  # the last layer's waits for its turn


def test_peak_live_bytes_over_a_prefix_of_the_order():
    from scheduling.order.list_scheduler import peak_live_bytes

    graph = _graph()
    ordered = order(graph, Placement(), 0.1)
    whole = peak_live_bytes(graph, ordered.nodes)
    assert peak_live_bytes(graph, ordered.nodes, until=len(ordered.nodes)) == whole
    prefixes = [peak_live_bytes(graph, ordered.nodes, until=k) for k in (1, 10, 40)]
    assert prefixes == sorted(prefixes) and prefixes[0] < whole


def test_gathered_bytes_in_flight_follow_the_lead():
    from scheduling.passes.prefetch import gathers_in_flight_bytes

    graph = _graph()
    one = WIDTH * WIDTH * 4  # a gathered float32 weight
    at_once = order(graph, Placement(), 0.1)
    assert gathers_in_flight_bytes(graph, at_once.nodes) == LAYERS * one
    led = order(graph, Placement(), 0.1, None, prefetch_bounds(graph, _seconds(3.0), 1.0))
    # Each starts three ops before its use, within the block before: one ahead at a time.
    assert gathers_in_flight_bytes(graph, led.nodes) == one


def _small_then_large(small, large, x):
    """One block reading a small gathered weight, then, five ops later, a large one (gathered
    first in program order)."""
    with jax.named_scope("layer_0"), jax.named_scope(PARAMETER_GATHER_SCOPE):
        w_large = jax.lax.all_gather(large, "x", tiled=True)
        w_small = jax.lax.all_gather(small, "x", tiled=True)
    for _ in range(4):
        x = jnp.tanh(x)
    x = x @ w_small
    for _ in range(4):
        x = jnp.tanh(x)
    return x @ w_large


def test_a_gather_read_sooner_starts_no_later_than_one_read_after_it():
    mesh = mesh_x()
    graph = split_async(
        capture(
            _small_then_large,
            sds(mesh, (WIDTH, WIDTH), P("x")),
            sds(mesh, (WIDTH, WIDTH), P("x")),
            sds(mesh, (N * 2, WIDTH), P("x")),
            mesh=mesh,
            in_specs=(P("x"), P("x"), P("x")),
            out_specs=P("x"),
        )
    )
    large, small = _starts(graph)
    assert min(graph.succs[small.partner]) < min(graph.succs[large.partner])

    def seconds(node):  # the large gather needs eight ops of lead, the small one one
        if node.role is Role.DONE:
            return 0.0
        if node.op.primitive == "all_gather":
            return 8.0 if node.op is large.op else 1.0
        return 1.0

    bounds = prefetch_bounds(graph, seconds, 1.0)
    # By its own lead the small one would start just before its use, after the large
    # one had taken the link: it starts with the large one instead.
    assert bounds[small.id] == bounds[large.id] < min(graph.succs[small.partner]) - 1
    ordered = order(graph, Placement(), 0.1, None, bounds)
    position = {node: i for i, node in enumerate(ordered.nodes)}
    # Together, in the order they are read: the link serves the small one first.
    assert position[small.id] < position[large.id]
    assert simulate(graph, ordered.nodes, seconds).collectives[small.id].stall == 0.0
