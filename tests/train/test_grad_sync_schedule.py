"""Gradient buckets in the scheduled step: deferrable, and never in a backward all-to-all's way.

``bucketed`` reduces each bucket as soon as its gradients exist, i.e. during the
backward pass, on the link the backward all-to-alls need. The scheduler classes
the buckets as deferrable (only the optimizer reads them), and the simulated
link serves a waiting all-to-all before any waiting bucket. The control runs the
same plan with one queue for all collectives: there buckets do hold up backward
all-to-alls, so the check can fail.
"""

import dataclasses

import pytest

from jaxmoe.config import ParallelConfig
from jaxmoe.parallel import build_mesh
from jaxmoe.train.scheduled import capture_train_step, schedule_policy
from scheduling import plan
from scheduling.describe import link_holders
from scheduling.graph import Role
from scheduling.optimize import cost_model
from scheduling.simulate import simulate
from scheduling.step_estimate import node_seconds

from .runs import small_config


@pytest.fixture(scope="module")
def planned():
    config = small_config(
        grad_sync="bucketed",
        grad_bucket_bytes=16 * 1024,
        schedule="dw",
        schedule_profile="cpu",
        schedule_link_mbit=50.0,
    )
    config = dataclasses.replace(config, parallel=ParallelConfig(data=2, expert=4))
    mesh = build_mesh(config.parallel)
    program, _ = capture_train_step(config, mesh)
    policy = schedule_policy(config)
    chosen = plan(program, policy)
    return chosen, node_seconds(cost_model(policy, mesh))


def bucket_starts(graph):
    return [
        node
        for node in graph.nodes
        if node.is_collective
        and node.role is not Role.DONE
        and "grad_reduce/bucket" in node.op.name_stack
    ]


def bucket_delay(graph, timeline) -> float:
    """Seconds during which backward all-to-alls waited for the link while a bucket held it."""
    delay = 0.0
    for start in graph.backward_all_to_alls():
        timing = timeline.collectives[start.id]
        _, deferrable = link_holders(timeline, timing.issued, timing.began)
        delay += deferrable
    return delay


def test_buckets_are_deferrable(planned):
    chosen, _ = planned
    starts = bucket_starts(chosen.graph)
    assert len(starts) >= 4  # 16 KiB buckets: several, so some are ready mid-backward
    assert {node.id for node in starts} <= chosen.graph.deferrable
    assert not {n.id for n in chosen.graph.backward_all_to_alls()} & chosen.graph.deferrable


def test_buckets_never_delay_a_backward_all_to_all(planned):
    chosen, seconds = planned
    graph, order = chosen.graph, chosen.schedule.order
    assert bucket_delay(graph, simulate(graph, order, seconds)) == 0.0
    # Control: one queue for all collectives, and the same buckets get in the way.
    assert bucket_delay(graph, simulate(graph, order, seconds, priorities=False)) > 0.0
