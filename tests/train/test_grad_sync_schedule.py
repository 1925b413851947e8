"""Gradient buckets in the scheduled step: deferrable, and never in a backward all-to-all's way.

``bucketed`` reduces each bucket once its gradients exist, on the link the
backward all-to-alls need. The scheduler classes the buckets as deferrable
(only the optimizer reads them) and the simulated link serves a waiting
all-to-all before any waiting bucket. In the planned step the buckets end up
after the backward all-to-alls; to exercise the priority, the same step is also
simulated with every bucket started as early as its gradients allow (as a
DDP-style runtime would). There no bucket takes the link while a backward
all-to-all waits for it; the control, one queue for all collectives, does let
buckets go first, so the check can fail.
"""

import dataclasses
import heapq

import pytest

from jaxmoe.config import ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve, schedule_policy
from jaxmoe.train.scheduled import capture_train_step
from scheduling import Phase, Role, cost_model, node_seconds, schedule, simulate

from .runs import linked, small_config, with_schedule


@pytest.fixture(scope="module")
def planned():
    config = small_config(grad_sync="bucketed", grad_bucket_bytes=16 * 1024)
    config = with_schedule(config, "dw", profile=linked("cpu", 50.0))
    # Four layers: the buckets of layer 3 are ready before layer 1's all-to-alls.
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, num_layers=4),
        parallel=ParallelConfig(data=2, expert=4),
    )
    mesh = build_mesh(config.parallel)
    program, _ = capture_train_step(resolve(config, mesh))
    policy = schedule_policy(config)
    return schedule(program, policy), node_seconds(cost_model(policy, mesh))


def bucket_starts(graph) -> list[int]:
    return [
        node.id
        for node in graph.nodes
        if node.is_collective
        and node.role is not Role.DONE
        and "grad_reduce/bucket" in node.op.name_stack
    ]


def eager_buckets(graph, order: list[int]) -> list[int]:
    """``order`` with each bucket (and what builds it) run as soon as its inputs exist."""
    rank = {node: position for position, node in enumerate(order)}
    eager = set()
    for start in bucket_starts(graph):
        # The bucket's start and what builds it after the backward pass (the concatenation).
        eager.add(start)
        eager.update(
            node
            for node in graph.members(graph.ancestors[start])
            if graph.nodes[node].op.phase is Phase.OPTIMIZER
        )
    waiting = {node: len(graph.preds[node]) for node in order}
    ready = [((node not in eager, rank[node]), node) for node in order if not waiting[node]]
    heapq.heapify(ready)
    result = []
    while ready:
        _, node = heapq.heappop(ready)
        result.append(node)
        for succ in graph.succs[node]:
            waiting[succ] -= 1
            if not waiting[succ]:
                heapq.heappush(ready, ((succ not in eager, rank[succ]), succ))
    assert len(result) == len(order)
    return result


def buckets_that_cut_in(graph, timeline) -> int:
    """Buckets that took the link while a backward all-to-all was waiting for it."""
    count = 0
    for start in graph.backward_all_to_alls():
        waits = timeline.collectives[start.id]
        for bucket in bucket_starts(graph):
            if waits.issued < timeline.collectives[bucket].began < waits.began:
                count += 1
    return count


def test_buckets_are_deferrable(planned):
    chosen, _ = planned
    starts = bucket_starts(chosen.graph)
    assert len(starts) >= 4  # 16 KiB buckets: several
    assert set(starts) <= chosen.graph.deferrable
    assert not {n.id for n in chosen.graph.backward_all_to_alls()} & chosen.graph.deferrable


def test_buckets_never_delay_a_backward_all_to_all(planned):
    chosen, seconds = planned
    graph = chosen.graph
    timeline = simulate(graph, chosen.order.nodes, seconds)
    for start in graph.backward_all_to_alls():
        waits = timeline.collectives[start.id]
        _, held_by_buckets = timeline.link_holders(waits.issued, waits.began)
        assert held_by_buckets == 0.0
    # Buckets started as early as possible: still none goes before a waiting all-to-all.
    eager = eager_buckets(graph, chosen.order.nodes)
    assert buckets_that_cut_in(graph, simulate(graph, eager, seconds)) == 0
    # Control: one queue for all collectives, and buckets do go first.
    assert buckets_that_cut_in(graph, simulate(graph, eager, seconds, priorities=False)) > 0
