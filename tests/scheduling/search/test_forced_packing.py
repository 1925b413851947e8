"""schedule_program scores dW packing with and without forcing each window's last
candidates into it, and keeps the shorter simulated step."""

from __future__ import annotations

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

from scheduling.policy import SchedulePolicy
from scheduling.program.capture import capture
from scheduling.search import step_estimate
from tests.scheduling.toys import as_backward, mesh_x, sds
from tests.scheduling.window_toys import chain_step, cost_model_seconds, forced_step


def _program(step=forced_step):
    mesh = mesh_x()
    return as_backward(
        capture(
            step,
            sds(mesh, (8, 4), P()),
            sds(mesh, (64, 4), P("x")),
            mesh=mesh,
            in_specs=(P(), P("x")),
            out_specs=P(),
        )
    )


@pytest.mark.parametrize("forced_shorter", [True, False])
def test_the_placement_of_the_shorter_simulated_step_is_kept(monkeypatch, forced_shorter):
    program = _program()
    simulate = step_estimate.simulate
    steps = []

    def simulated(graph, nodes, seconds):
        # The first order simulated is the forced packing's, the second the other's.
        timeline = simulate(graph, nodes, seconds)
        step = 1.0 if (len(steps) == 0) == forced_shorter else 2.0
        steps.append(step)
        return dataclasses.replace(timeline, step_seconds=step)

    monkeypatch.setattr(step_estimate, "simulate", simulated)
    graph = step_estimate.split_async(program)
    seconds = cost_model_seconds(graph)
    _, order, timeline = step_estimate.schedule_program(
        program, SchedulePolicy("dw"), seconds, pack_dw=True
    )
    assert len(steps) == 2 and timeline.step_seconds == 1.0
    assert bool(order.placement.forced) == forced_shorter
    # Without forcing, the window takes only what fits it best.
    assert all(order.placement.windows.values())


def test_a_packing_that_forces_nothing_is_scored_once(monkeypatch):
    program = _program(chain_step)  # its one candidate chain fits the first window
    calls = []
    simulate = step_estimate.simulate
    monkeypatch.setattr(step_estimate, "simulate", lambda *args: calls.append(1) or simulate(*args))
    graph = step_estimate.split_async(program)
    _, order, _ = step_estimate.schedule_program(
        program, SchedulePolicy("dw"), cost_model_seconds(graph), pack_dw=True
    )
    assert not order.placement.forced and len(calls) == 1
