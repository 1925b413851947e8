"""Schedules of the real train step on folded layouts compute what the unscheduled step does.

Each case is a layout of 8 fake devices with tensor (and sequence) parallelism,
expert-tensor parallelism, or both, folded with the expert group. ``async`` and
``dw`` must be bit for bit equal to the unscheduled step. ``partition`` and
``lancet`` (and ``comet``, whose pieces are matmuls of fewer rows too) drop the
same tokens and give the same losses and metrics within the tolerances of
tests/train/test_partitioned.py (XLA compiles matmuls of fewer
rows with other roundings); the parameters after five AdamW steps are compared
to 1e-3, a tenth of one step's update at learning rate 1e-2: Adam divides by
the root of the second moment, so a gradient near zero that moves by an ulp
moves its update by a fraction of a step (up to 4e-4 measured on the
unpartitioned layouts of today's step, ``lancet`` in 2 chunks).

A case runs once the model's program has the collectives of its layout: a
forward tensor all-gather (``parallel.tensor``) or expert-tensor gather/scatter
(``parallel.expert_tensor``), found in the captured program by
:mod:`scheduling.program.collective_purpose`. Until then it is skipped, saying why.
"""

import dataclasses
import functools

import chex
import pytest

from jaxmoe.config import MoEConfig, ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import axis_roles, capture_train_step, scheduled_train_step
from scheduling import Phase, collective_purposes
from tests.train.runs import with_schedule
from tests.train.test_comet import forced
from tests.train.test_partitioned import ALWAYS, EXACT_METRICS, partitioned
from tests.train.test_scheduled import run, small

# As tests/train/test_partitioned.py: its tolerances hold for five steps of 32 rows.
STEPS = 5
TOP2_DROPS = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0)
CASES = {
    # The expert group (4) spans the tensor axis (2).
    "tensor2-folded": (ParallelConfig(data=2, expert=4, tensor=2), TOP2_DROPS),
    "expert_tensor2": (ParallelConfig(data=2, expert=2, expert_tensor=2), TOP2_DROPS),
    "tensor2-expert_tensor2": (
        ParallelConfig(data=2, expert=2, tensor=2, expert_tensor=2),
        MoEConfig(num_experts=8, top_k=2, capacity_factor=None),
    ),
    "tensor2-all_gather-dispatcher": (
        ParallelConfig(data=2, expert=4, tensor=2),
        dataclasses.replace(TOP2_DROPS, dispatcher="all_gather"),
    ),
}


def _config(case: str):
    parallel, moe = CASES[case]
    config = small(parallel, moe, layers=2, moe_every=1)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=32))


@functools.cache
def _forward_purposes(case: str) -> frozenset[str]:
    config = _config(case)
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel)))
    return frozenset(
        purpose
        for op, purpose in collective_purposes(program, axis_roles()).items()
        if op.phase is Phase.FORWARD
    )


def _skip_until_the_layout_changes_the_program(case: str) -> None:
    parallel, _ = CASES[case]
    purposes = _forward_purposes(case)
    wanted = []
    if parallel.tensor > 1:
        wanted.append("tensor all_gather")
    if parallel.expert_tensor > 1:
        wanted.append("expert-tensor all_gather")
    missing = [w for w in wanted if not any(p.startswith(w) for p in purposes)]
    if missing:
        pytest.skip(f"the step of {parallel} has no forward {' or '.join(missing)} yet")


def _assert_same_training(result, reference) -> None:
    (history, state), (expected_history, expected_state) = result, reference

    def exact(history):
        return [{name: metrics[name] for name in EXACT_METRICS} for metrics in history]

    chex.assert_trees_all_equal(exact(history), exact(expected_history))
    chex.assert_trees_all_close(history, expected_history, rtol=2e-5, atol=1e-6)
    chex.assert_trees_all_close(state, expected_state, rtol=0, atol=1e-3)


@functools.cache
def _reference(case: str):
    return run(with_schedule(_config(case), "none"), steps=STEPS)


# expert_tensor2 alone is slow: tensor2-expert_tensor2 folds both axes by default. So are
# the all_gather dispatcher (the folded layout's other exchange), dw where lancet packs the
# same work on the same layout, partition (lancet's ranges without the packing), and async
# (dw splits the collectives as async does, and moves work: bit for bit on the same layout).
SLOW_LAYOUTS = {"expert_tensor2", "tensor2-all_gather-dispatcher"}
SLOW_CASES = {
    ("dw", "tensor2-expert_tensor2"),
    ("partition", "tensor2-folded"),
    ("async", "tensor2-folded"),
    ("lancet", "tensor2-folded"),  # lancet on tensor2-expert_tensor2 folds the tensor axis too
}


def _cases(pairs: list[tuple[str, str]]) -> list:
    return [
        pytest.param(
            schedule, case, id=f"{schedule}-{case}",
            marks=pytest.mark.slow
            if case in SLOW_LAYOUTS or (schedule, case) in SLOW_CASES
            else (),
        )
        for schedule, case in pairs
    ]  # fmt: skip


# dw on every layout; async (its collectives split, nothing moved) on the folded one.
REORDERINGS = [("dw", case) for case in CASES] + [("async", "tensor2-folded")]


@pytest.mark.parametrize(("schedule", "case"), _cases(REORDERINGS))
def test_reordering_schedules_are_bitwise_equal_on_folded_layouts(case, schedule):
    _skip_until_the_layout_changes_the_program(case)
    result = run(with_schedule(_config(case), schedule), steps=STEPS)
    chex.assert_trees_all_equal(result, _reference(case))


# lancet (the forward partitioned, dW packed into the windows) on every layout; partition
# (the same ranges, nothing packed) on the folded one.
PARTITIONINGS = [("lancet", case) for case in CASES] + [("partition", "tensor2-folded")]


@pytest.mark.parametrize(("schedule", "case"), _cases(PARTITIONINGS))
def test_partitioning_schedules_match_on_folded_layouts(case, schedule):
    _skip_until_the_layout_changes_the_program(case)
    result = run(partitioned(_config(case), schedule, chunks=2), steps=STEPS, experimental=ALWAYS)
    _assert_same_training(result, _reference(case))


def test_the_folded_expert_exchange_is_named_from_the_program():
    # Today's step on a folded mesh: the expert group spans the tensor axis.
    purposes = _forward_purposes("tensor2-folded")
    assert {"expert all_to_all (dispatch)", "expert all_to_all (combine)"} <= purposes


@pytest.mark.parametrize(
    ("case", "exchange"),
    [
        ("tensor2-folded", "chunks:2"),
        pytest.param("tensor2-folded", "rounds:4", marks=pytest.mark.slow),
        pytest.param("expert_tensor2", "chunks:2", marks=pytest.mark.slow),
        ("tensor2-expert_tensor2", "rounds:2"),
    ],
)
def test_comet_decomposes_the_folded_exchange_and_matches(case, exchange):
    # tensor2-folded: the expert group (4) spans the tensor axis, so the all-to-all runs over
    # an axis tuple; with expert_tensor the pieces' GEMMs sit between expert-tensor gathers.
    _skip_until_the_layout_changes_the_program(case)
    config, options = with_schedule(_config(case), "comet"), forced(exchange)
    mesh = build_mesh(config.parallel)
    planned = scheduled_train_step(resolve(config, mesh), options)
    report = planned.report
    assert report.exchanges, "no MoE exchange recognised on the folded mesh"
    assert [layer.decomposition for layer in report.exchanges] == [exchange] * 2, [
        (layer.decomposition, layer.why) for layer in report.exchanges
    ]
    # The step of this report, trained.
    result = run(config, steps=STEPS, compiled=(mesh, planned.compile()))
    _assert_same_training(result, _reference(case))
