"""Where a planned step's exposed communication goes, by what each collective is for.

The planner's estimate says how long a step's compute stream waits for communication in
all (:class:`jaxmoe.plan.estimates.StepTime`); this says for which collectives. The
mapping's step is traced as the planner traces it (two blocks and three for a deep model),
scheduled under the schedule the planner chose, and simulated on the cost model. Each
collective's stall (the compute stream's wait at its done) is summed by its purpose
(:func:`scheduling.collective_purposes`, e.g. ``expert all_to_all (dispatch)``); the
stalls sum to the simulated exposed communication. A stall is the whole wait at that
done, for the collectives the link runs before it too, so a purpose may be waited for
longer than its own transfers take. A deep model's figures are on the planner's line
through two traced depths (:func:`jaxmoe.plan.layer_extrapolation.line_depths`: two
blocks and three, deeper where its live-bytes bound withdrew placements at one of them
only, and two blocks and eight for a paired schedule), so they sum to the extrapolated
exposed communication before the planner's floor at zero.

It also says how many forward ranges the schedule partitioned: Lancet's partition cuts a
device's rows into chunks (:mod:`scheduling.search.partition_search`), so a step of one
row a device has none to cut.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any

import scheduling
from jaxmoe.config import Config
from jaxmoe.plan.layer_extrapolation import block_count, extrapolates, line_depths, with_blocks
from jaxmoe.plan.tracer import trace, with_schedule
from jaxmoe.train.resolved import schedule_policy
from scheduling import batch_inputs, collective_purposes, cost_model, node_seconds, simulate


@dataclass(frozen=True)
class ExposedCommunication:
    """A step's communication by purpose: seconds the compute stream waits at its
    collectives, and seconds the link runs them."""

    schedule: str
    exposed: dict[str, float]  # purpose -> seconds
    communication: dict[str, float]  # purpose -> seconds
    rows_per_device: int  # the rows a device's step holds (its microbatches' together)
    partitioned_ranges: int  # forward ranges the schedule cut into chunks

    @property
    def exposed_seconds(self) -> float:
        return sum(self.exposed.values())

    def largest(self, count: int, least: float = 0.0) -> list[tuple[str, float, float]]:
        """The ``count`` purposes waited for longest, each more than ``least`` seconds:
        purpose, exposed, communication."""
        ranked = sorted(self.exposed, key=self.exposed.__getitem__, reverse=True)
        kept = [p for p in ranked[:count] if self.exposed[p] > least]
        return [(p, self.exposed[p], self.communication[p]) for p in kept]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> ExposedCommunication:
        return ExposedCommunication(**data)


@dataclass(frozen=True)
class _Step:
    """One traced step's stalls and link seconds by purpose, the forward ranges it
    partitioned, whether its live-bytes bound withdrew placements, and its ops as traced."""

    exposed: dict[str, float]
    linked: dict[str, float]
    ranges: int
    bound_withdrew: bool
    ops: int


def _traced_step(config: Config, schedule: str, profile: str) -> _Step:
    """``config``'s step under ``schedule``, by purpose (:class:`_Step`)."""
    config = with_schedule(config, schedule, profile)
    traced = trace(config)
    program, step = traced.program, traced.step
    policy = schedule_policy(config)
    cost = cost_model(policy, program.mesh, program).priced_once()
    scheduled = scheduling.schedule(
        program, policy, cost, batch_inputs(program, step.batch_argnums)
    )
    seconds = node_seconds(cost.rebound(scheduled.graph.program))
    timeline = simulate(scheduled.graph, scheduled.order.nodes, seconds)
    purposes = collective_purposes(scheduled.graph.program)
    exposed: collections.Counter[str] = collections.Counter()
    linked: collections.Counter[str] = collections.Counter()
    for timing in timeline.collectives.values():
        node = scheduled.graph.nodes[timing.node]
        purpose = purposes.get(node.op, node.op.primitive)
        exposed[purpose] += timing.stall
        linked[purpose] += seconds(node)
    withdrew = scheduled.order.withdrawn_for_bound > 0
    return _Step(dict(exposed), dict(linked), len(scheduled.partitions), withdrew, len(program.ops))


def exposed_communication(config: Config, schedule: str, profile: str) -> ExposedCommunication:
    """``config``'s step (a mapped configuration, as the planner estimates it) under
    ``schedule`` on ``profile``: its communication by purpose (module docstring)."""
    rows = config.train.batch_size // config.parallel.batch_shards
    if not extrapolates(config):
        step = _traced_step(config, schedule, profile)
        return ExposedCommunication(schedule, step.exposed, step.linked, rows, step.ranges)
    blocks = block_count(config)
    assert blocks is not None
    steps: dict[int, _Step] = {}

    def at(depth: int) -> _Step:
        if depth not in steps:
            steps[depth] = _traced_step(with_blocks(config, depth), schedule, profile)
        return steps[depth]

    first, second = line_depths(
        schedule, lambda depth: at(depth).bound_withdrew, blocks, lambda depth: at(depth).ops
    )
    shallow, deeper = at(first), at(second)
    further = (blocks - first) / (second - first)  # the line's steps beyond the shallow trace

    def deep(first: dict[str, float], second: dict[str, float]) -> dict[str, float]:
        return {
            p: first.get(p, 0.0) + further * (second.get(p, 0.0) - first.get(p, 0.0))
            for p in sorted(first.keys() | second.keys())
        }

    ranges = round(shallow.ranges + further * (deeper.ranges - shallow.ranges))
    return ExposedCommunication(
        schedule,
        deep(shallow.exposed, deeper.exposed),
        deep(shallow.linked, deeper.linked),
        rows,
        ranges,
    )
