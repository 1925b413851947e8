"""schedule_program scores dW packing with each window's last candidates forced into it
and, where they overfill it, without; it keeps the shorter simulated step (or, as a
research option, the packing asked for)."""

from __future__ import annotations

import dataclasses

import pytest
from jax.sharding import PartitionSpec as P

from scheduling.policy import ExperimentalOptions, PolicyError, SchedulePolicy
from scheduling.program.capture import capture
from scheduling.search import step_estimate
from tests.scheduling.toys import as_backward, fixed_seconds, mesh_x, sds
from tests.scheduling.window_toys import dw_candidates, forced_step, two_windows


def _program():
    mesh = mesh_x()
    return as_backward(
        capture(
            forced_step,
            sds(mesh, (8, 4), P()),
            sds(mesh, (64, 4), P("x")),
            mesh=mesh,
            in_specs=(P(), P("x")),
            out_specs=P(),
        )
    )


def _seconds(program, window):
    """Each all-to-all ``window`` s; the two candidates forced into the first 5 s each."""
    graph = step_estimate.split_async(program)
    first, second = two_windows(graph)
    n1, n2, free = dw_candidates(graph, first)
    costs = {first.id: window, second.id: window, n1: 5.0, n2: 5.0, free: 0.5}
    return fixed_seconds(costs, default=0.1)


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
    _, order, timeline = step_estimate.schedule_program(
        program, SchedulePolicy("dw"), _seconds(program, window=1.0), pack_dw=True
    )
    assert len(steps) == 2 and timeline.step_seconds == 1.0
    assert bool(order.placement.forced) == forced_shorter


def test_a_window_its_forced_work_fits_is_scored_once(monkeypatch):
    program = _program()
    calls = []
    simulate = step_estimate.simulate
    monkeypatch.setattr(step_estimate, "simulate", lambda *args: calls.append(1) or simulate(*args))
    _, order, _ = step_estimate.schedule_program(
        program, SchedulePolicy("dw"), _seconds(program, window=20.0), pack_dw=True
    )
    assert order.placement.forced and len(calls) == 1


@pytest.mark.parametrize("force_dw", [True, False])
def test_the_research_option_takes_one_packing_whatever_the_step(monkeypatch, force_dw):
    program = _program()
    calls = []
    simulate = step_estimate.simulate
    monkeypatch.setattr(step_estimate, "simulate", lambda *args: calls.append(1) or simulate(*args))
    seconds = _seconds(program, window=1.0)  # the forced work overfills the window
    _, order, _ = step_estimate.schedule_program(
        program, SchedulePolicy("dw"), seconds, pack_dw=True, force_dw=force_dw
    )
    assert bool(order.placement.forced) == force_dw and len(calls) == 1


def test_the_research_option_applies_to_the_policies_that_pack_dw_work():
    ExperimentalOptions(force_dw=False).check(SchedulePolicy("lancet"))
    with pytest.raises(PolicyError, match=r"ExperimentalOptions.force_dw=False: applies to"):
        ExperimentalOptions(force_dw=False).check(SchedulePolicy("async"))
