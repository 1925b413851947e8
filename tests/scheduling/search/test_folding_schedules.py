"""Schedules of folded tensor/expert-parallel toy steps stay exact (tests/scheduling/folding_toys).

``async`` and ``dw`` only reorder equations and split collectives into start/done
pairs: the scheduled step is bitwise equal to the ``shard_map`` it came from.
``partition`` and ``lancet`` also cut forward ranges into row chunks; each chunk
computes the same rows with the same operations, and the sequence all-gathers and
reduce-scatters run per chunk. On the ``folded`` toy that is bitwise too; on the
``expert_tensor`` toy results move by an ulp (6e-8 after one step), because
XLA:CPU's dot kernel rounds a matmul of fewer rows differently: the same
``[2, 8, 8, 4] x [4, 4]`` product and its two row halves differ by up to 5e-7.
"""

from __future__ import annotations

import functools

import chex
import pytest

import scheduling
from scheduling.passes.partition_forward import consumers_of, cut_range, partition_program
from scheduling.policy import ExperimentalOptions, SchedulePolicy
from scheduling.program.batch_layout import analyze
from scheduling.program.capture import Phase
from scheduling.runtime.emit import emit
from scheduling.search.schedule import batch_inputs, cost_model
from scheduling.search.step_estimate import node_seconds, schedule_program
from tests.scheduling import folding_toys as toys
from tests.scheduling.toys import reference

LAYOUTS = sorted(toys.LAYOUTS)
STEPS = 3
# Partitioned steps against the reference: float32 results of order 1..100 after three
# updates, allowed to differ by a few ulps.
ULPS = 1e-6


@functools.cache
def _reference(layout_name: str):
    layout = toys.LAYOUTS[layout_name]
    return reference(
        toys.make_step(layout), layout.mesh, toys.in_specs(layout), toys.out_specs(layout)
    )


def _optimized(layout_name: str, policy: SchedulePolicy, experimental=None):
    layout = toys.LAYOUTS[layout_name]
    return scheduling.optimize(
        toys.make_step(layout),
        *toys.shapes(layout),
        mesh=layout.mesh,
        in_specs=toys.in_specs(layout),
        out_specs=toys.out_specs(layout),
        policy=policy,
        batch_argnums=(1,),
        experimental=experimental,
    )


def _iterate(step, params, x):
    losses = []
    for _ in range(STEPS):
        params, loss = step(params, x)
        losses.append(loss)
    return params, losses


def _runs(layout_name: str, step):
    params, x = toys.args(toys.LAYOUTS[layout_name])
    expected = _iterate(_reference(layout_name), params, x)
    chex.assert_tree_all_finite(expected)
    return _iterate(step, params, x), expected


def test_toys_have_the_collectives_of_a_folded_layer():
    for layout in toys.LAYOUTS.values():
        forward = {
            (op.primitive, op.eqn.params.get("axis_name"))
            for op in toys.program(layout).collectives()
            if op.phase is Phase.FORWARD
        }
        assert ("all_gather", layout.tensor) in forward
        assert ("reduce_scatter", layout.tensor) in forward
        assert ("all_to_all", layout.expert) in forward
        assert len(layout.expert) == 2 or ("all_gather", layout.expert_tensor) in forward


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("policy", ["async", "dw"])
def test_reordering_schedules_are_bitwise_exact(layout_name, policy):
    step, report = _optimized(layout_name, SchedulePolicy(name=policy))
    assert report.collectives and all(c.is_async for c in report.collectives)
    got, expected = _runs(layout_name, step)
    chex.assert_trees_all_equal(got, expected)
    assert len({float(loss) for loss in got[1]}) == STEPS  # the parameters did change


@pytest.mark.parametrize("layout_name", LAYOUTS)
@pytest.mark.parametrize("policy", ["partition", "lancet"])
def test_partitioning_schedules_are_exact_to_ulps(layout_name, policy):
    step, report = _optimized(
        layout_name,
        SchedulePolicy(name=policy, partition_chunks=2),
        ExperimentalOptions(partition_always=True),
    )
    assert report.partitions
    got, expected = _runs(layout_name, step)
    chex.assert_trees_all_close(got, expected, rtol=ULPS, atol=ULPS)


def _whole_layer_cut(program, n):
    """The range from the sequence gather to the end of the MoE layer, in ``n`` chunks."""
    layouts = analyze(program, batch_inputs(program, (1,)))
    end = max(
        op.index + 1
        for op in program.ops
        if op.phase is Phase.FORWARD and op.layer.startswith("layer_0")
    )
    return layouts, cut_range(program, layouts, consumers_of(program), 0, end, n)


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_the_sequence_parallel_block_is_chunked_with_the_moe_layer(layout_name):
    program = toys.program(toys.LAYOUTS[layout_name])
    _, cut = _whole_layer_cut(program, 2)
    chunked = {program.ops[p].primitive for p in cut.chunked}
    assert {"all_gather", "reduce_scatter", "all_to_all"} <= chunked
    assert cut.end == _whole_layer_cut(program, 2)[1].end and not cut.deferred
    # Each sequence collective starts a pipeline stage of its own.
    gather, scatter = (
        next(p for p in cut.chunked if program.ops[p].primitive == kind)
        for kind in ("all_gather", "reduce_scatter")
    )
    assert cut.stages[scatter] > cut.stages[gather]


@pytest.mark.parametrize("layout_name", LAYOUTS)
# 4 pieces lie between 2 and 8: slow.
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow), 8])
@pytest.mark.parametrize("pack_dw", [False, True])
def test_the_whole_layer_partitioned_is_exact_to_ulps(layout_name, n, pack_dw):
    layout = toys.LAYOUTS[layout_name]
    program = toys.program(layout)
    layouts, cut = _whole_layer_cut(program, n)
    partitioned = partition_program(program, layouts, [cut])
    gathers = [op for op in partitioned.ops if op.primitive == "all_gather"]
    assert len(gathers) > n  # the attention gather runs once per chunk
    policy = SchedulePolicy(name="lancet" if pack_dw else "partition")
    seconds = node_seconds(cost_model(policy, layout.mesh))
    graph, schedule, _ = schedule_program(partitioned, policy, seconds, pack_dw)
    got, expected = _runs(layout_name, emit(graph, schedule))
    chex.assert_trees_all_close(got, expected, rtol=ULPS, atol=ULPS)
