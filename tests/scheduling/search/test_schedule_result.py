"""What ``schedule`` hands back besides the order: the timeline that scored it, and a graph
made once per program for every schedule that splits it alike."""

from __future__ import annotations

import pytest

from scheduling.costs.cost_model import CostModel
from scheduling.passes import split_async, unsplit
from scheduling.policy import SchedulePolicy
from scheduling.profiles import DeviceProfile
from scheduling.search.schedule import batch_inputs, schedule
from scheduling.search.step_estimate import estimate
from tests.scheduling.search import partition_toys as toys

PROGRAM = toys.program(toys.pipelined_loss)
# A link slow enough beside the compute that the order decides what is exposed.
PROFILE = DeviceProfile("toy", 1e9, 1e9, 1e-6, 1e7, 1e-6)


@pytest.mark.parametrize("name", ["none", "async", "dw", "partition", "lancet"])
def test_the_timeline_is_the_order_simulated(name):
    cost = CostModel(PROFILE, dict(PROGRAM.mesh.shape)).bound_to(PROGRAM)
    policy = SchedulePolicy(name=name, profile=PROFILE)
    scheduled = schedule(PROGRAM, policy, cost, batch_inputs(PROGRAM, (1,)))
    again = estimate(scheduled.graph, scheduled.order, cost)
    assert scheduled.timeline.step_seconds == again.step_seconds > 0
    assert scheduled.timeline.collectives == again.collectives
    assert scheduled.timeline.events == again.events


def test_the_schedules_of_a_program_share_its_graphs():
    split = split_async(PROGRAM)
    assert split_async(PROGRAM) is split
    assert unsplit(PROGRAM) is unsplit(PROGRAM) is not split
    assert not any(node.partner is not None for node in unsplit(PROGRAM).nodes)
    # Split otherwise (small collectives kept whole), or another program: another graph.
    assert split_async(PROGRAM, min_bytes=1 << 40) is not split
    alike = toys.program(toys.pipelined_loss)
    assert split_async(alike) is not split
    assert len(split_async(alike).nodes) == len(split.nodes)
