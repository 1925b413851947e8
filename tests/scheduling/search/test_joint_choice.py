"""The joint choice: ``lancet`` is never estimated worse than ``async``, ``dw`` or ``partition``.

Ranked by the simulated whole step, then by exposed all-to-all: where ``lancet``
is no slower than ``partition`` it hides at least as much of the all-to-all.
Checked on the partition toys under hypothesis-generated device profiles.
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduling.costs.cost_model import CostModel
from scheduling.costs.simulate import simulate
from scheduling.policy import SchedulePolicy
from scheduling.profiles import DeviceProfile
from scheduling.search.schedule import batch_inputs, schedule
from scheduling.search.step_estimate import exposed_all_to_all, node_seconds
from tests.scheduling.search import partition_toys as toys

LOSSES = {
    "pipelined": toys.pipelined_loss,
    "batch_statistic": toys.loss_with_batch_statistic,
    "prefix_over_batch": toys.prefix_over_batch_loss,
}
PROGRAMS = {name: toys.program(loss) for name, loss in LOSSES.items()}


def _rank(program, policy: SchedulePolicy, cost: CostModel) -> tuple[float, float]:
    cost = cost.bound_to(program)  # as schedule() prices it: the program's kernels,
    scheduled = schedule(program, policy, cost, batch_inputs(program, (1,)))
    priced = cost.rebound(scheduled.graph.program)  # and a partitioned program's its own
    timeline = simulate(scheduled.graph, scheduled.order.nodes, node_seconds(priced))
    return timeline.step_seconds, exposed_all_to_all(scheduled.graph, timeline)


def _log_uniform(low: float, high: float):
    return st.floats(0.0, 1.0).map(lambda u: low * (high / low) ** u)


profiles = st.builds(
    lambda flops, memory, overhead, link, latency, fused: DeviceProfile(
        "generated", flops, memory, overhead, link, latency, fused_elementwise=fused
    ),
    _log_uniform(1e6, 1e12),
    _log_uniform(1e6, 1e12),
    _log_uniform(1e-9, 1e-4),
    _log_uniform(1e3, 1e10),
    _log_uniform(1e-9, 1e-3),
    st.booleans(),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(PROGRAMS)), profile=profiles)
# Slow compute and a slow link: partition then dW packing, composed, lost to partition.
@example(name="batch_statistic", profile=DeviceProfile("slow", 1e6, 1e6, 1e-9, 1e3, 1e-9))
def test_lancet_is_never_estimated_worse_than_its_parts(name, profile):
    program = PROGRAMS[name]
    cost = CostModel(profile, dict(program.mesh.shape))
    lancet = _rank(program, SchedulePolicy(name="lancet", profile=profile), cost)
    for part in ("async", "dw", "partition"):
        other = _rank(program, SchedulePolicy(name=part, profile=profile), cost)
        assert lancet <= other, (part, lancet, other)
