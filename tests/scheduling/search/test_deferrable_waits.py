"""schedule_program waits for a gradient reduction where the simulated link has finished
it, not before the update: its operand is not held to the end of the step, and the wait
costs the compute stream nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from scheduling.policy import SchedulePolicy
from scheduling.program.capture import capture
from scheduling.program.graph import Role
from scheduling.search.step_estimate import schedule_program
from tests.scheduling.toys import fixed_seconds, mesh_x, sds


def _step(x):
    gradient_like = jax.lax.psum(x * 3.0, "x")  # only returned: deferrable
    y = x
    for _ in range(6):
        y = jnp.tanh(y * 1.5)
    return gradient_like, y


def test_a_gradient_reduction_is_waited_for_where_its_transfer_has_ended():
    mesh = mesh_x()
    program = capture(
        _step, sds(mesh, (64, 4), P("x")), mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"))
    )
    probe, _, _ = schedule_program(program, SchedulePolicy("async"), lambda node: 1.0, False)
    (start,) = [node.id for node in probe.nodes if node.role is Role.START]
    assert start in probe.deferrable
    # Each computation 1 s, the reduction 2.5 s: issued after the first multiply (at 1 s),
    # its transfer ends at 3.5 s; it is waited for before the first computation that
    # begins after that, the fifth.
    seconds = fixed_seconds({start: 2.5}, default=1.0)
    graph, ordered, timeline = schedule_program(program, SchedulePolicy("async"), seconds, False)
    nodes = ordered.nodes
    done = graph.nodes[start].partner
    computations = [n for n in nodes if graph.nodes[n].role is Role.COMPUTE]
    after = [n for n in computations if nodes.index(n) > nodes.index(done)]
    assert len(after) == len(computations) - 4  # not held to the end of the step
    assert timeline.exposed_communication_seconds == 0.0
    assert timeline.step_seconds == len(computations)
