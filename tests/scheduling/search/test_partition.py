"""The forward partition: cutting ranges, the search's choice of n, and exactness on toy steps."""

from __future__ import annotations

import itertools

import chex
import numpy as np
import pytest

import scheduling
from scheduling.passes.partition_forward import consumers_of, cut_range, partition_program
from scheduling.policy import ExperimentalOptions, SchedulePolicy
from scheduling.program.batch_layout import analyze
from scheduling.program.capture import Phase, aval_bytes
from scheduling.program.partition_rules import Split
from scheduling.runtime.emit import emit
from scheduling.search.partition_search import op_groups, pipeline_seconds, search
from scheduling.search.schedule import batch_inputs
from scheduling.search.step_estimate import schedule_program
from tests.scheduling.search import partition_toys as toys
from tests.scheduling.toys import reference


def _layouts(program):
    return analyze(program, batch_inputs(program, (1,)))


# Every range that can be partitioned is, so that each is checked for exactness.
ALWAYS = ExperimentalOptions(partition_always=True)


def _optimized(loss_fn, **policy):
    policy = SchedulePolicy(**{"name": "partition", **policy})
    return scheduling.optimize(
        toys.make_step(loss_fn),
        *toys.shapes(),
        mesh=toys.mesh_x(),
        in_specs=toys.IN_SPECS,
        out_specs=toys.OUT_SPECS,
        policy=policy,
        batch_argnums=(1,),
        experimental=ALWAYS,
    )


def _assert_matches_reference(loss_fn, step):
    expected = reference(toys.make_step(loss_fn), toys.mesh_x(), toys.IN_SPECS, toys.OUT_SPECS)
    args = toys.args()
    # A chunked reduction sums in another order: float32 rounding of the largest values.
    chex.assert_trees_all_close(step(*args), expected(*args), rtol=1e-5, atol=1e-5)


def _forward_all_to_alls(program):
    return [op for op in program.ops if op.primitive == "all_to_all" and op.phase is Phase.FORWARD]


# Hand-computed pipeline: 2 ms of compute per stage, then 1 + 4 ms per all-to-all chunk.
def test_pipeline_seconds_by_hand():
    # n = 4: compute 2, 2 | link 2-7, 7-12, 12-17, 17-22 | stage 1 waits: ends at 24.
    assert pipeline_seconds([2e-3, 2e-3], [5e-3], 4) == pytest.approx(24e-3)
    # n = 1: 8 + 17 + 8.
    assert pipeline_seconds([8e-3, 8e-3], [17e-3], 1) == pytest.approx(33e-3)
    # Compute-bound: the link never holds the compute stream back after the first chunk.
    assert pipeline_seconds([4e-3, 4e-3], [1e-3], 2, before=1e-3, after=2e-3) == pytest.approx(
        1e-3 + 4e-3 + 4e-3 + 4e-3 + 4e-3 + 2e-3
    )


def _hand_costs(program):
    """Each matmul 8 ms for the whole batch, each all-to-all 1 ms + 16 ms for all of it."""
    full = toys.BATCH * toys.TOKENS * toys.D

    def seconds(op):
        size = sum(np.prod(v.aval.shape) for v in op.outputs)
        if op.primitive == "dot_general":
            return 8e-3 * size / full
        if op.primitive == "all_to_all":
            return 1e-3 + 16e-3 * size / full
        return 0.0

    return seconds


def test_search_finds_the_chunk_count_known_by_hand():
    # T(n) = 8/n + n (1 + 16/n) + 8/n ms on a link-bound pipeline: T(2) = 26,
    # T(4) = 24, T(8) = 26, and 33 unpartitioned. n must divide the batch of 8.
    program = toys.program(toys.pipelined_loss)
    (choice,) = search(program, _layouts(program), _hand_costs(program))
    assert choice.cut.n == 4
    assert choice.estimated_seconds == pytest.approx(24e-3)
    assert choice.unpartitioned_seconds == pytest.approx(33e-3)
    for n, expected in ((2, 26e-3), (8, 26e-3)):
        (forced,) = search(program, _layouts(program), _hand_costs(program), chunk_counts=(n,))
        assert forced.estimated_seconds == pytest.approx(expected)


def test_search_keeps_no_partition_that_does_not_pay():
    program = toys.program(toys.pipelined_loss)

    def compute_only(op):  # no communication cost: chunking only adds work
        return 0.0 if op.primitive == "all_to_all" else 1e-3

    assert search(program, _layouts(program), compute_only) == []
    assert search(program, _layouts(program), compute_only, always=True)


# 4 pieces lie between 2 and 8: slow.
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow), 8])
def test_partitioned_step_matches_the_reference(n):
    step, report = _optimized(toys.pipelined_loss, partition_chunks=n)
    assert [p.chunks for p in report.partitions] == [n]
    _assert_matches_reference(toys.pipelined_loss, step)


def test_chunk_counts_that_do_not_divide_the_batch_are_not_tried():
    program = toys.program(toys.pipelined_loss)
    layouts = _layouts(program)
    (a2a,) = _forward_all_to_alls(program)
    assert cut_range(program, layouts, consumers_of(program), 0, a2a.index + 1, 3) is None
    assert search(program, layouts, _hand_costs(program), chunk_counts=(3, 5, 6, 7)) == []


def test_a_reduction_over_the_batch_splits_the_ranges_around_it():
    program = toys.program(toys.loss_with_batch_statistic)
    step, report = _optimized(toys.loss_with_batch_statistic, partition_chunks=2)
    assert len(report.partitions) == 2
    layouts = _layouts(program)
    choices = search(program, layouts, lambda op: 1e-3, chunk_counts=(2,), always=True)
    statistic = [
        op.index
        for op in program.ops
        if op.primitive == "reduce_sum" and op.layer == "layer_0/statistic"
    ]
    assert statistic
    chunked = {p for choice in choices for p in choice.cut.chunked}
    assert not chunked & set(statistic)
    first, second = (choice.cut for choice in choices)
    assert first.end <= min(statistic) or set(statistic) <= set(first.deferred)
    # Each range holds one of the two all-to-alls.
    exchanges = [op.index for op in _forward_all_to_alls(program)]
    assert [sum(e in cut.chunked for e in exchanges) for cut in (first, second)] == [1, 1]
    _assert_matches_reference(toys.loss_with_batch_statistic, step)


def test_a_prefix_sum_along_the_batch_carries_across_chunks():
    program = toys.program(toys.prefix_over_batch_loss)
    layouts = _layouts(program)
    cumsum = [op for op in program.ops if op.primitive == "cumsum" and op.phase is Phase.FORWARD]
    assert cumsum
    assert all(layouts.chunkings[op.index].carry == "add" for op in cumsum)
    step, report = _optimized(toys.prefix_over_batch_loss, partition_chunks=4)
    assert report.partitions and report.partitions[0].chunks == 4
    _assert_matches_reference(toys.prefix_over_batch_loss, step)


@pytest.mark.parametrize("n", [2, 4])
def test_a_loop_over_tiles_runs_chunk_by_chunk(n):
    """The loop of tiled_loss (a ``scan`` whose carries the loop splits) is cut with the
    range before the exchange: each chunk runs the loop rebuilt at its size."""
    program = toys.program(toys.tiled_loss)
    layouts = _layouts(program)
    (loop,) = [op for op in program.ops if op.primitive == "scan"]
    assert layouts.chunkings[loop.index].outputs == (Split(0), Split(1))
    (a2a,) = _forward_all_to_alls(program)
    cut = cut_range(program, layouts, consumers_of(program), 0, a2a.index + 1, n)
    assert cut is not None and loop.index in cut.chunked
    partitioned = partition_program(program, layouts, [cut])
    loops = [op for op in partitioned.ops if op.primitive == "scan"]
    assert [op.outputs[0].aval.shape[0] for op in loops] == [toys.BATCH // n] * n
    policy = SchedulePolicy(name="partition")
    graph, order, _ = schedule_program(partitioned, policy, lambda node: 1e-3, pack_dw=False)
    step = emit(graph, order)
    expected = reference(
        toys.make_step(toys.tiled_loss), toys.mesh_x(), toys.IN_SPECS, toys.OUT_SPECS
    )
    chex.assert_trees_all_close(step(*toys.args()), expected(*toys.args()), rtol=1e-6, atol=1e-6)


def test_all_to_all_bytes_do_not_grow():
    program = toys.program(toys.loss_with_batch_statistic)
    layouts = _layouts(program)
    cuts = [
        choice.cut
        for choice in search(program, layouts, lambda op: 1e-3, chunk_counts=(4,), always=True)
    ]
    partitioned = partition_program(program, layouts, cuts)

    def exchanged(p):
        return sum(
            aval_bytes(a.aval) for op in p.ops if op.primitive == "all_to_all" for a in op.inputs
        )

    assert len(_forward_all_to_alls(partitioned)) == 4 * len(_forward_all_to_alls(program))
    assert exchanged(partitioned) == exchanged(program)


def test_op_groups_cover_the_forward_pass_and_end_at_each_all_to_all():
    program = toys.program(toys.loss_with_batch_statistic)
    groups = op_groups(program)
    assert groups[0][0] == 0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    for op in _forward_all_to_alls(program):
        assert any(end == op.index + 1 for _, end in groups)


def test_partition_needs_the_batch_arguments():
    with pytest.raises(ValueError, match="batch_argnums"):
        scheduling.optimize(
            toys.make_step(toys.pipelined_loss),
            *toys.shapes(),
            mesh=toys.mesh_x(),
            in_specs=toys.IN_SPECS,
            out_specs=toys.OUT_SPECS,
            policy="partition",
        )
