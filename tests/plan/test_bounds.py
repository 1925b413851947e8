"""The planner's bounds (jaxmoe/plan/bounds.py): one trace of a layout bounds the step time
and the memory of every option set of it, as the planner estimates them.

A six-layer model (three blocks) on 4 devices, on a folded layout (tensor 2, an expert
group of 2 inside it), with the dense attention core (the one whose weights recomputing
the core attention drops; the flash cores' option sets have no such recomputation): the
bounds come from one one-block trace at ZeRO-1 with full recomputation; each option set is
then estimated from its two- and three-block traces.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from jaxmoe.cli import parser as cli
from jaxmoe.plan import estimates, tracer
from jaxmoe.plan.mappings import enumerate_mappings, with_options
from jaxmoe.plan.options import Options, bounding, option_sets

PROFILE = "h100-8x-nvlink-3200g"
SIX_LAYERS = [
    "--preset", "tiny", "--model.num_layers", "6", "--model.d_model", "32",
    "--model.num_heads", "2", "--model.d_ff", "64", "--model.seq_len", "16",
    "--moe.num_experts", "4", "--train.batch_size", "8", "--model.attention", "dense",
]  # fmt: skip
VARIANTS = [
    Options(zero, recompute, 1)
    for zero in (0, 1, 3)
    for recompute in ("none", "attention", "matmuls", "layer")
] + [Options(0, "none", 2), Options(3, "attention", 2), Options(1, "matmuls", 2)]


@functools.cache
def layout():
    args = cli.parse(["plan", *SIX_LAYERS, "--devices", "4", "--profile", PROFILE])
    config = cli.resolve_config(args)
    (found,) = [
        c
        for c in enumerate_mappings(config, 4, 8).valid
        if (c.mapping.tensor, c.mapping.expert, c.mapping.expert_tensor, c.mapping.dispatcher)
        == (2, 2, 1, "all_to_all")
    ]
    return found


@functools.cache
def plan_traces() -> tracer.Tracer:
    return tracer.Tracer(["none"], PROFILE, estimates.EstimateCache(None))


@functools.cache
def screened():
    sets = option_sets(layout().config)
    assert bounding(sets) == Options(1, "layer", 1)
    traced = with_options(layout(), bounding(sets), 8)
    return plan_traces().screen(traced.config, extrapolate_layers=True)


@functools.cache
def estimated(options: Options):
    variant = with_options(layout(), options, 8)
    assert variant.config is not None, variant.reason
    memory, times = tracer.estimate_mapping(
        variant.config, ["none"], PROFILE, estimates.EstimateCache(None), tracer=plan_traces()
    )
    return variant.config, memory, times["none"].step


# By default each ZeRO stage, each recomputation and both microbatch counts once; the rest
# of the option sets are slow.
DEFAULT_VARIANTS = {
    Options(0, "none", 1), Options(1, "layer", 1), Options(3, "attention", 2),
    Options(1, "matmuls", 1),
}  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [pytest.param(o, marks=() if o in DEFAULT_VARIANTS else pytest.mark.slow) for o in VARIANTS],
    ids=lambda o: o.label(),
)
def test_one_trace_bounds_every_option_set(options):
    config, memory, step = estimated(options)
    bounds = screened()
    assert bounds.step_bound(options) <= step
    assert bounds.memory_bound(options, tracer.state_bytes(config)) <= memory.total


def test_the_bounds_are_close_where_nothing_is_taken_away():
    options = Options(1, "layer", 1)
    config, memory, step = estimated(options)
    bounds = screened()
    # Each further block's update (its parameters' clipping and optimizer steps) is
    # counted with the block: 0.94 of the step (0.88 when it was left outside the
    # blocks). What is left out is what the bounding trace materialises that this set
    # fuses.
    assert bounds.step_bound(options) == pytest.approx(step, rel=0.08)
    # ZeRO-1's gathered parameters and the head's backward pass counted (0.55 without).
    assert bounds.memory_bound(options, tracer.state_bytes(config)) > 0.9 * memory.total


def test_the_flash_cores_have_no_core_recomputation_to_choose():
    flash = dataclasses.replace(
        layout().config, model=dataclasses.replace(layout().config.model, attention="auto")
    )
    assert {o.recompute for o in option_sets(flash)} == {"none", "matmuls", "layer"}
    assert {o.recompute for o in option_sets(layout().config)} == {
        "none", "attention", "matmuls", "layer"
    }  # fmt: skip


def test_recomputing_less_is_bounded_by_what_the_recomputation_keeps():
    bounds = screened()
    state = tracer.state_bytes(with_options(layout(), Options(0, "none", 1), 8).config)
    kept, without_core, matmuls, recomputing = (
        bounds.memory_bound(Options(0, recompute, 1), state)
        for recompute in ("none", "attention", "matmuls", "layer")
    )
    # The core attention's values (queries-keys matmul to the values' matmul) are found.
    assert bounds.recomputed_core.block > 0
    assert kept > without_core > recomputing
    # ``matmuls`` keeps the results of the weight matmuls and the exchanges, not the
    # norms, the activations or the core attention's.
    elementwise = bounds.recomputed.block - bounds.recomputed_core.block
    assert 0 < bounds.recomputed_matmuls.block < elementwise
    assert kept > matmuls > recomputing


def test_a_swiglu_block_that_keeps_its_forward_values_is_bounded():
    """Recomputed, the SwiGLU's values are made again as written (the gate's sigmoid and
    silu); a block that keeps its forward values keeps the activation's input alone
    (jaxmoe/layers/activations.py): the bound from the recomputing trace counts none of
    the activation's values for it, and holds."""
    args = cli.parse(
        ["plan", *SIX_LAYERS, "--model.activation", "swiglu", "--devices", "4",
         "--profile", PROFILE]
    )  # fmt: skip
    config = cli.resolve_config(args)
    (found,) = [
        c
        for c in enumerate_mappings(config, 4, 8).valid
        if (c.mapping.tensor, c.mapping.expert, c.mapping.expert_tensor, c.mapping.dispatcher)
        == (2, 2, 1, "all_to_all")
    ]
    traces = tracer.Tracer(["none"], PROFILE, estimates.EstimateCache(None))
    bounds = traces.screen(with_options(found, Options(1, "layer", 1), 8).config, True)
    plain = with_options(found, Options(1, "none", 1), 8).config
    memory, _ = tracer.estimate_mapping(
        plain, ["none"], PROFILE, estimates.EstimateCache(None), tracer=traces
    )
    bound = bounds.memory_bound(Options(1, "none", 1), tracer.state_bytes(plain))
    assert bounds.options.recompute == "layer" and bound <= memory.total


# A link far slower than the devices (10 MB/s between any two): the step's collectives
# take longer than its computation, which the schedules that overlap them cannot change.
SLOW_LINK = dict(
    name="slow-link", flops_per_s=1e15, memory_bytes_per_s=3e12, op_overhead_s=5e-6,
    link_bytes_per_s=1e7, link_latency_s=1e-5,
)  # fmt: skip
OVERLAPPING = ["none", "dw", "lancet"]


@pytest.mark.parametrize(
    # Recomputing less and a lower ZeRO stage (their parts of the link taken away): slow.
    "options",
    [
        Options(1, "layer", 1),
        pytest.param(Options(0, "none", 1), marks=pytest.mark.slow),
        pytest.param(Options(3, "attention", 2), marks=pytest.mark.slow),
    ],
)
def test_the_link_bounds_a_step_whose_schedules_overlap_communication(tmp_path, options):
    """Under schedules that may hide communication behind computation, the link still runs
    every collective one at a time: its work bounds the step where it exceeds the
    computation. Recomputing less takes away the recomputed exchanges, a lower ZeRO
    stage the parameter gathers."""
    profile = tmp_path / "slow-link.json"
    profile.write_text(json.dumps(SLOW_LINK))
    traces = tracer.Tracer(OVERLAPPING, str(profile), estimates.EstimateCache(None))
    sets = option_sets(layout().config)
    bounds = traces.screen(with_options(layout(), bounding(sets), 8).config, True)
    variant = with_options(layout(), options, 8).config
    _, times = tracer.estimate_mapping(
        variant, OVERLAPPING, str(profile), estimates.EstimateCache(None), tracer=traces
    )
    fastest = min(t.step for t in times.values())
    assert bounds.link_recomputing.block > 0 and bounds.link_sharding.block > 0
    # The link binds: computation alone bounds the traced options' step at 0.24 of the
    # fastest schedule's, the link at 0.72 (ZeRO-0 without recomputation: 0.47, its
    # all-reduces bounded by the reduce-scatters they replace).
    assert bounds.step_bound(options) == bounds.link_bound(options) <= fastest
    if options == bounds.options:  # nothing taken away
        assert bounds.step_bound(options) >= 0.65 * fastest


def test_a_schedule_that_rewrites_the_exchanges_is_bounded_by_its_computation(tmp_path):
    """``comet`` turns each all-to-all into rounds of other collectives, which may cost
    the link less than the exchange: its screens count the computation alone."""
    profile = tmp_path / "slow-link.json"
    profile.write_text(json.dumps(SLOW_LINK))
    traces = tracer.Tracer(["none", "comet"], str(profile), estimates.EstimateCache(None))
    options = bounding(option_sets(layout().config))
    bounds = traces.screen(with_options(layout(), options, 8).config, True)
    assert not bounds.link_bounds
    assert bounds.step_bound(options) < bounds.link_bound(options)


def test_a_variant_in_fewer_microbatches_is_not_bounded():
    bounds = screened()  # one microbatch
    with pytest.raises(ValueError, match="as many microbatches or more"):
        bounds.step_bound(Options(1, "layer", 0))


@functools.cache
def pipelined_layout():
    """An eight-layer model on 4 devices: 2 stages of 2 devices (an expert group of 2),
    and the same stage layout without a pipeline (4 devices: 2 expert replicas)."""
    args = cli.parse(
        ["plan", *SIX_LAYERS, "--model.num_layers", "8", "--devices", "4", "--profile", PROFILE]
    )
    config = cli.resolve_config(args)
    space = enumerate_mappings(config, 4, 8, pipelines=[(1, 1), (2, 1)])
    (plain, staged) = [
        c
        for c in space.valid
        if (c.mapping.tensor, c.mapping.expert, c.mapping.expert_tensor) == (1, 2, 1)
        and c.mapping.dispatcher == "all_to_all"
    ]
    assert (plain.mapping.pipeline, staged.mapping.pipeline) == (1, 2)
    return plain, staged


@pytest.mark.parametrize(
    ("zero", "microbatches"),
    # Two microbatches lie between one and four, which run by default: slow.
    [(0, 1), pytest.param(0, 2, marks=pytest.mark.slow), (0, 4), (1, 4)],
)
def test_a_stage_layout_without_a_pipeline_bounds_its_pipelines(zero, microbatches):
    plain, staged = pipelined_layout()
    sets = option_sets(plain.config)
    bounds = plan_traces().screen(with_options(plain, bounding(sets), 8).config, True)
    options = Options(zero, "none", microbatches)
    variant = with_options(staged, options, 8)
    memory, times = tracer.estimate_mapping(
        variant.config, ["none"], PROFILE, estimates.EstimateCache(None), tracer=plan_traces()
    )
    # One microbatch runs each op once per tick over two ticks of half the layers: the
    # per-op overheads of one pass, not of two; four run them four times over. The ops
    # on parameters alone (casts, transposes) run once a tick whatever its rows, and
    # every stage runs the head on its rows (without both: 0.75 of the estimate; with both,
    # 0.79 where a kernel's fused operands differ between the traces). The estimate's
    # norms normalise again in the backward pass (they keep their inputs alone), the
    # bound's, from a recomputing trace, do not: 0.749 of it.
    assert 0.74 * times["none"].step <= bounds.pipeline_step_bound(options, 2, 1)
    assert bounds.pipeline_step_bound(options, 2, 1) <= times["none"].step
    state = tracer.state_bytes(variant.config)
    memory_bound = bounds.pipeline_memory_bound(options, state, 2, 1)
    assert memory_bound <= memory.total
    # Both ticks' forward slots keep a set (one stage's on zeros); of four microbatches,
    # three forward slots' sets are held before the first microbatch's backward slot on
    # the first stage (0.61 and 0.67 of the estimate; counting the slots up to the first
    # backward slot alone, two, 0.54 and 0.60).
    assert memory_bound >= 0.6 * memory.total


def test_screens_round_trip_through_json():
    bounds = screened()
    assert type(bounds).from_json(bounds.to_json()) == bounds


# ZeRO-1 with 4 microbatches on a pipeline is another option set for the same claim (its
# bounds are checked by default in the stage-layout test above): slow.
@pytest.mark.parametrize(
    "options", [Options(0, "none", 2), pytest.param(Options(1, "none", 4), marks=pytest.mark.slow)]
)
def test_a_pipelines_own_one_block_screen_bounds_it_closely(options):
    """Three blocks per chunk: the screen traces one and scales the chunk's blocks (under
    ``chunk_layer_<j>`` in the ticks) to three; a bound of the one-block step alone would
    be under half of the estimate."""
    args = cli.parse(
        ["plan", *SIX_LAYERS, "--model.num_layers", "12", "--devices", "4", "--profile", PROFILE]
    )
    config = cli.resolve_config(args)
    (staged,) = [
        c
        for c in enumerate_mappings(config, 4, 8, pipelines=[(2, 1)]).valid
        if (c.mapping.tensor, c.mapping.expert, c.mapping.dispatcher) == (1, 2, "all_to_all")
    ]
    variant = with_options(staged, options, 8)
    own = plan_traces().screen(variant.config, True)
    assert own.blocks == 3
    memory, times = tracer.estimate_mapping(
        variant.config, ["none"], PROFILE, estimates.EstimateCache(None), tracer=plan_traces()
    )
    assert 0.8 * times["none"].step <= own.step_bound(options) <= times["none"].step
    assert own.memory_bound(options, tracer.state_bytes(variant.config)) <= memory.total


def test_uneven_chunks_are_bounded_as_the_longest():
    """Three blocks over two stages: every stage runs two block positions (one of them
    padding on the second stage), as four blocks would."""
    bounds = screened()
    assert bounds.blocks == 3
    four = dataclasses.replace(bounds, blocks=4)
    options = Options(1, "layer", 2)
    assert bounds.pipeline_step_bound(options, 2, 1) == pytest.approx(
        four.pipeline_step_bound(options, 2, 1)
    )
    state = tracer.state_bytes(layout().config)
    assert bounds.pipeline_memory_bound(options, state, 2, 1) == pytest.approx(
        four.pipeline_memory_bound(options, state, 2, 1), rel=1e-9
    )


def test_leading_dense_layers_are_bounded_outside_the_blocks():
    """DeepSeek's shape, small: two leading dense layers (each with more work than an MoE
    block), then three MoE blocks of latent attention. Counted as blocks, the dense layers
    would be multiplied by the block count and the bound would exceed the estimate."""
    args = cli.parse(
        ["plan", "--preset", "deepseek_v3-tiny", "--model.num_layers", "5",
         "--model.first_dense_layers", "2", "--model.d_model", "32", "--model.num_heads",
         "2", "--model.d_ff", "256", "--model.seq_len", "16", "--model.kv_lora_rank", "8",
         "--model.q_lora_rank", "8", "--model.qk_nope_head_dim", "8",
         "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "8", "--moe.num_experts",
         "8", "--moe.d_expert", "8", "--train.batch_size", "8", "--devices", "4",
         "--profile", PROFILE]
    )  # fmt: skip
    config = cli.resolve_config(args)
    (found,) = [
        c
        for c in enumerate_mappings(config, 4, 8).valid
        if (c.mapping.tensor, c.mapping.expert, c.mapping.dispatcher) == (1, 4, "all_to_all")
    ]
    traced = with_options(found, Options(1, "layer", 1), 8)
    bounds = plan_traces().screen(traced.config, extrapolate_layers=True)
    steps = {}
    for options in (Options(1, "layer", 1), Options(0, "none", 1)):
        variant = with_options(found, options, 8).config
        memory, times = tracer.estimate_mapping(
            variant, ["none"], PROFILE, estimates.EstimateCache(None), tracer=plan_traces()
        )
        steps[options] = times["none"].step
        assert bounds.step_bound(options) <= steps[options]
        assert bounds.memory_bound(options, tracer.state_bytes(variant)) <= memory.total
    traced_options = Options(1, "layer", 1)
    assert bounds.step_bound(traced_options) == pytest.approx(steps[traced_options], rel=0.3)


# Two microbatches are the same claim on a screen of its own: slow.
@pytest.mark.parametrize("microbatches", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_pipelines_own_screen_bounds_its_option_sets_in_as_many_microbatches(microbatches):
    """Where a pipeline's stage layout is not valid without a pipeline, the planner bounds
    its option sets from a screen of its own in each number of microbatches, of the set
    that recomputes most: less recomputation and a lower ZeRO stage are taken away."""
    _, staged = pipelined_layout()
    sets = [o for o in option_sets(staged.config) if o.microbatches == microbatches]
    traced = bounding(sets)
    assert (traced.zero, traced.recompute) == (1, "layer")
    bounds = plan_traces().screen(with_options(staged, traced, 8).config, True)
    for options in (Options(0, "none", microbatches), Options(1, "matmuls", microbatches)):
        variant = with_options(staged, options, 8)
        memory, times = tracer.estimate_mapping(
            variant.config, ["none"], PROFILE, estimates.EstimateCache(None), tracer=plan_traces()
        )
        # Measured: 0.89 to 0.91 of the estimate.
        assert 0.85 * times["none"].step <= bounds.step_bound(options) <= times["none"].step
        state = tracer.state_bytes(variant.config)
        assert bounds.memory_bound(options, state) <= memory.total, options
