"""The partitioned train step (schedules ``partition`` and ``lancet``) computes what the
unpartitioned one computes.

Routing is decided per routing group and chunks hold whole groups, so which
tokens are dropped is identical, step for step. The arithmetic is the same op
for op; XLA compiles the chunked program differently (different fusions around
the reassembled residuals, so elementwise math is vectorised differently),
which moves gradients by a few ulps. Losses and metrics are compared to 2e-5
relative; parameters after five AdamW steps at learning rate 1e-2 to 5e-5
absolute, half a percent of one step's update, but for the few elements whose
gradient cancels (:func:`tests.train.runs.assert_trained_close`): within one
update of 1e-3.
"""

import dataclasses
import functools

import chex
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmoe.config import Config, MoEConfig, ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.presets import preset
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step
from scheduling import ExperimentalOptions, SchedulePolicy, aval_bytes, batch_inputs, schedule
from scheduling.program.batch_layout import analyze
from scheduling.program.capture import Phase
from tests.train.runs import assert_trained_close, with_schedule
from tests.train.test_scheduled import run, small

EXACT_METRICS = ("dropped_fraction", "expert_imbalance")


# Every range that can be partitioned is, so that each is checked for exactness.
ALWAYS = ExperimentalOptions(partition_always=True)


def partitioned(config: Config, schedule: str, chunks: int | None = None) -> Config:
    return with_schedule(config, schedule, partition_chunks=chunks)


def assert_same_training(result, reference):
    (history, state), (expected_history, expected_state) = result, reference

    def exact(history):
        return [{name: metrics[name] for name in EXACT_METRICS} for metrics in history]

    chex.assert_trees_all_equal(exact(history), exact(expected_history))
    chex.assert_trees_all_close(history, expected_history, rtol=2e-5, atol=1e-6)
    assert_trained_close(state, expected_state, rtol=1e-4, atol=5e-5, update=1e-3)


CASES = {
    "2x4-top2-drops-lancet": ((2, 4), MoEConfig(8, top_k=2, capacity_factor=1.0), "lancet", 2),
    "1x8-top1-dropless-n4": ((1, 8), MoEConfig(8, top_k=1, capacity_factor=None), "partition", 4),
    "4x2-top1-drops-n4": ((4, 2), MoEConfig(4, top_k=1, capacity_factor=0.5), "lancet", 4),
    "2x4-top2-dropless-search": (
        (2, 4),
        MoEConfig(8, top_k=2, capacity_factor=None),
        "partition",
        None,
    ),
}


# The 2x4 case with drops and lancet by default. The dropless one with the chunk search is
# slow: padded dropless dispatch partitioned is checked by default on the folded layouts
# (tests/train/test_folded_schedules.py), partition is lancet's ranges without the dW
# packing, and the search's choice is tests/scheduling/search/test_partition.py's.
SLOW_CASES = {"1x8-top1-dropless-n4", "4x2-top1-drops-n4", "2x4-top2-dropless-search"}


@pytest.mark.parametrize(
    ("mesh", "moe", "schedule", "chunks"),
    [
        pytest.param(*case, id=name, marks=pytest.mark.slow if name in SLOW_CASES else ())
        for name, case in CASES.items()
    ],
)
def test_partitioned_training_matches_over_five_steps(mesh, moe, schedule, chunks):
    config = small(ParallelConfig(*mesh), moe, layers=2, moe_every=1)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=32))
    reference = run(with_schedule(config, "none"), steps=5)
    if moe.capacity_factor is not None:  # the cases with drops: they happen, and match
        assert all(m["dropped_fraction"] > 0 for m in reference[0])
    result = run(partitioned(config, schedule, chunks), steps=5, experimental=ALWAYS)
    assert_same_training(result, reference)


# Slow: the 2x4 drops case above checks that drops happen in every step and match.
@pytest.mark.slow
def test_drops_happen_and_match():
    moe = MoEConfig(num_experts=8, top_k=2, capacity_factor=0.5)
    config = small(ParallelConfig(2, 4), moe)
    reference = run(with_schedule(config, "none"), steps=2)
    assert all(m["dropped_fraction"] > 0 for m in reference[0])
    assert_same_training(
        run(partitioned(config, "partition"), steps=2, experimental=ALWAYS), reference
    )


# Slow: generated meshes, capacities and depths for the claim the default 2x4 cases check
# (the 1x8 dropless example is the slow 1x8-top1-dropless-n4 case).
@pytest.mark.slow
@settings(
    max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    mesh=st.sampled_from([(1, 8), (2, 4), (4, 2)]),
    top_k=st.integers(1, 2),
    capacity=st.sampled_from([None, 0.5, 1.25]),
    layers=st.integers(1, 3),
    schedule=st.sampled_from(["partition", "lancet"]),
)  # fmt: skip
def test_partitioned_training_matches_on_generated_configs(mesh, top_k, capacity, layers, schedule):
    moe = MoEConfig(num_experts=8, top_k=top_k, capacity_factor=capacity)
    config = small(ParallelConfig(*mesh), moe, layers=layers, moe_every=1)
    reference = run(with_schedule(config, "none"), steps=2)
    assert_same_training(
        run(partitioned(config, schedule), steps=2, experimental=ALWAYS), reference
    )


def _all_to_all_bytes(program) -> int:
    return sum(
        aval_bytes(atom.aval)
        for op in program.ops
        if op.primitive == "all_to_all"
        for atom in op.inputs
    )


@functools.cache
def _captured(config: Config):
    """The captured train step of ``config`` and its batch inputs: the step does not depend
    on the schedule section, so the cases below schedule one capture of the default preset
    (scheduling reads a program, never changes it)."""
    program, sharded = capture_train_step(resolve(config, build_mesh(config.parallel)))
    return program, batch_inputs(program, sharded.batch_argnums)


def _captured_and_scheduled(config: Config, policy: SchedulePolicy, experimental=None):
    """The captured train step of ``config`` and the schedule ``policy`` makes of it."""
    program, batch = _captured(with_schedule(config, "none", partition_chunks=None))
    return program, schedule(program, policy, batch_inputs=batch, experimental=experimental)


@pytest.mark.parametrize("chunks", [None, 2, 4])
def test_default_preset_all_to_all_bytes_grow_at_most_ten_percent(chunks):
    policy = SchedulePolicy(name="lancet", profile="cpu", partition_chunks=chunks)
    always = ExperimentalOptions(partition_always=chunks is not None)
    program, scheduled = _captured_and_scheduled(preset("tiny"), policy, always)
    if chunks is not None:
        assert scheduled.partitions and all(c.cut.n == chunks for c in scheduled.partitions)
    before, after = _all_to_all_bytes(program), _all_to_all_bytes(scheduled.graph.program)
    assert after <= 1.10 * before
    assert after == before  # chunks hold whole routing groups: nothing is padded


def test_report_lists_each_partitioned_range(tmp_path):
    config = partitioned(preset("tiny"), "lancet", chunks=2)
    scheduled = scheduled_train_step(resolve(config, build_mesh(config.parallel)), ALWAYS)
    report = scheduled.report
    assert report.partitions
    for part in report.partitions:
        assert part.chunks == 2
        assert any(layer.endswith("/moe") for layer in part.layers)
        assert part.first_op and part.last_op
    assert "partitioned" in report.table()
    data = report.to_json()
    assert data["partitions"][0]["chunks"] == 2


def test_expert_pipeline_chunks_each_moe_layer_between_its_all_to_alls():
    config = partitioned(preset("tiny"), "expert_pipeline", chunks=4)
    policy = SchedulePolicy(name="expert_pipeline", partition_chunks=4)
    program, scheduled = _captured_and_scheduled(config, policy)
    assert len(scheduled.partitions) == len(config.model.moe_layers)
    for choice in scheduled.partitions:
        first, last = program.ops[choice.cut.begin], program.ops[choice.cut.end - 1]
        assert first.primitive == last.primitive == "all_to_all"
        assert first.layer == last.layer and first.layer.endswith("/moe")
        assert choice.cut.n == 4


# Mixtral's and Qwen2-MoE's RMSNorm (Qwen3-MoE's is the same), DeepSeek-V3's latent attention;
# the attention core a loop over tiles (the blockwise core at sequences longer than a tile).
@pytest.mark.parametrize("family", ["mixtral-tiny", "qwen2_moe-tiny", "deepseek_v3-tiny"])
def test_the_batch_reaches_each_familys_expert_exchanges(family):
    """Lancet's partition follows the batch from the step's inputs (scheduling.program.
    batch_layout): through RMSNorm (its epsilon broadcast, then given an axis of 1) and the
    blockwise attention's loop to the expert all-to-alls, so that their ranges can be cut."""
    config = preset(family)
    model = dataclasses.replace(config.model, attention_block=config.model.seq_len // 4)
    config = dataclasses.replace(config, model=model)
    program, step = capture_train_step(resolve(config, build_mesh(config.parallel)))
    layouts = analyze(program, batch_inputs(program, step.batch_argnums))
    loops = [op.index for op in program.ops if op.primitive == "scan" and op.phase is Phase.FORWARD]
    assert loops and all(position in layouts.chunkings for position in loops)
    exchanges = [
        position
        for position, op in enumerate(program.ops)
        if op.primitive == "all_to_all" and op.phase is Phase.FORWARD
    ]
    assert exchanges and all(position in layouts.chunkings for position in exchanges)
