"""The planner's depth extrapolation: two- and three-block traces give what a whole trace
gives, for memory exactly and for the simulated step to round-off (``none``) or at the
block boundaries (``dw``)."""

from __future__ import annotations

import dataclasses
import types

import pytest

from jaxmoe.cli import parser as cli
from jaxmoe.config import Config, ConfigError, ModelConfig
from jaxmoe.plan import estimates, tracer
from jaxmoe.plan.layer_extrapolation import (
    MAX_LINE_OPS,
    MAX_TRACED_BLOCKS,
    PAIRED_LINE_DEPTH,
    TRACED_BLOCKS,
    agreeing_depth,
    block_count,
    extrapolate,
    extrapolates,
    line_depths,
    screens_shallow,
    with_blocks,
)
from jaxmoe.plan.mappings import (
    Mapping,
    chunk_layers_of,
    enumerate_mappings,
    pipelines_of,
    with_mapping,
)
from jaxmoe.plan.memory import StepMemory

PROFILE = "h100-8x-nvlink-3200g"


def tiny(layers: int, devices: int) -> Config:
    """The planner tests' tiny model with ``layers`` layers (an MoE every two), planned on
    ``devices`` devices."""
    args = cli.parse(
        ["plan", "--preset", "tiny", "--model.num_layers", str(layers),
         "--model.d_model", "32", "--model.num_heads", "2", "--model.d_ff", "64",
         "--model.seq_len", "16", "--moe.num_experts", "4", "--train.batch_size", "8",
         "--devices", str(devices), "--profile", PROFILE]
    )  # fmt: skip
    return cli.resolve_config(args)


def test_blocks_are_whole_repeats_of_the_moe_period():
    assert block_count(Config(model=ModelConfig(num_layers=6, moe_every=2))) == 3
    assert block_count(Config(model=ModelConfig(num_layers=5, moe_every=2))) is None
    assert not extrapolates(Config(model=ModelConfig(num_layers=6, moe_every=2)))
    assert extrapolates(Config(model=ModelConfig(num_layers=8, moe_every=2)))
    assert with_blocks(Config(model=ModelConfig(num_layers=8)), 1).model.num_layers == 2
    # Leading dense layers (DeepSeek's) stand before the blocks.
    leading = Config(model=ModelConfig(num_layers=7, moe_every=1, first_dense_layers=2))
    assert block_count(leading) == 5
    assert with_blocks(leading, 2).model.num_layers == 4


def test_uneven_chunks_are_planned_as_their_longest_chunk():
    # 7 blocks of 2 layers over 4 chunks: 2, 2, 2 and 1 blocks.
    assert chunk_layers_of(14, 2, 4) == "4,4,4,2"
    assert chunk_layers_of(16, 2, 4) is None
    model = ModelConfig(num_layers=14, moe_every=2)
    # Stages dividing 8 devices, every chunk at least one block: 8 x 1 stays out.
    assert pipelines_of(Config(model=model), 8) == [(1, 1), (2, 1), (2, 2), (4, 1)]
    mapping = Mapping(8, 1, 1, 2, 1, "all_to_all", pipeline=4)
    config = with_mapping(Config(model=model), mapping, devices_per_host=8)
    assert config.parallel.chunk_layers == "4,4,4,2"
    # Every stage holds and runs the longest chunk: estimated as equal chunks of 2 blocks.
    assert block_count(config) == 2
    shallow = with_blocks(config, 2)
    assert (shallow.model.num_layers, shallow.parallel.chunk_layers) == (16, None)


def test_extrapolate_is_the_line_through_two_and_three_blocks():
    @dataclasses.dataclass(frozen=True)
    class Figures:
        bytes: int
        seconds: float

    assert TRACED_BLOCKS == (2, 3)
    two, three = Figures(100, 1.5), Figures(130, 2.0)
    assert extrapolate(two, three, 2) == two
    assert extrapolate(two, three, 3) == three
    assert extrapolate(two, three, 56) == Figures(100 + 54 * 30, 1.5 + 54 * 0.5)
    assert isinstance(extrapolate(two, three, 56).bytes, int)
    with pytest.raises(ValueError, match="blocks=0"):
        extrapolate(two, three, 0)


def test_an_extrapolated_step_is_no_shorter_than_its_computation_or_its_link():
    """The second block's communication hides better than the first's: the exposed
    communication shrinks a block at a time, and its line would take the step under the
    computation (and the link's work) at depth. The step runs both to the end."""
    two = estimates.StepTime(step=10.0, compute=6.0, communication=5.0, exposed_communication=4.0)
    three = estimates.StepTime(step=11.0, compute=8.0, communication=9.0, exposed_communication=3.0)
    deep = tracer._extrapolated_time(two, three, 9)
    assert (deep.compute, deep.communication) == (20.0, 33.0)
    assert deep.step == 33.0  # the line alone: 17
    assert deep.exposed_communication == 0.0  # the line alone: -3
    assert tracer._extrapolated_time(two, three, 3) == three


@pytest.fixture
def traced_layers(monkeypatch) -> list[int]:
    """The layers of each step the planner traces, in order."""
    found: list[int] = []
    capture = tracer.capture_train_step

    def counting(run):
        found.append(run.config.model.num_layers)
        return capture(run)

    monkeypatch.setattr(tracer, "capture_train_step", counting)
    return found


@pytest.fixture(scope="module")
def eight_layer_mappings():
    """Two mappings of an eight-layer (four-block) model on 4 devices: an expert group
    alone, and tensor with expert-tensor parallelism."""
    config = tiny(layers=8, devices=4)
    assert block_count(config) == 4
    found = {
        (c.mapping.tensor, c.mapping.expert, c.mapping.expert_tensor): c.config
        for c in enumerate_mappings(config, 4, 8).valid
        if c.mapping.dispatcher == "all_to_all"
    }
    return {mapping: found[mapping] for mapping in MAPPINGS}


# (tensor, expert, expert_tensor). The expert group alone is slow: the tensor-parallel
# mapping's blocks have the larger boundaries, the closer check of the extrapolation.
MAPPINGS = ((1, 4, 1), (2, 2, 2))


@pytest.mark.parametrize(
    "mapping", [pytest.param(MAPPINGS[0], marks=pytest.mark.slow), MAPPINGS[1]], ids=str
)
def test_extrapolated_estimates_match_whole_traces(eight_layer_mappings, mapping, traced_layers):
    schedules = ["none", "dw"]
    cache = estimates.EstimateCache(None)
    config = eight_layer_mappings[mapping]
    memory, times = tracer.estimate_mapping(config, schedules, PROFILE, cache)
    assert traced_layers == [4, 6]  # two blocks, three blocks; never the whole depth
    whole_memory, whole_times = tracer.estimate_mapping(
        config, schedules, PROFILE, cache, extrapolate_layers=False
    )
    assert traced_layers == [4, 6, 8]
    assert memory == whole_memory
    # Exact but for fusion: an expensive elementwise value that one block reads once XLA
    # fuses into its reader, and gives a buffer where several blocks read it.
    assert times["none"].step == pytest.approx(whole_times["none"].step, rel=1e-4)
    # dw overlaps weight gradients across block boundaries, which are a large part of this
    # tiny model's blocks: its last block adds more than those before it (the tensor-
    # parallel mapping's second, third and fourth blocks add 876, 881 and 941 us, the
    # expert group's 776, 786 and 835), so the line through two and three blocks is 1.5%
    # and 1.4% under the four-block step (the line through one and two, 1.8% and 2.0%).
    assert times["dw"].step == pytest.approx(whole_times["dw"].step, rel=2e-2)


def test_a_model_of_few_blocks_is_traced_whole():
    config = Config(model=ModelConfig(num_layers=4, moe_every=2))
    assert not extrapolates(config) and not screens_shallow(config)
    with pytest.raises(ConfigError):
        with_blocks(config, 0)


def test_a_three_block_model_is_screened_from_one_block_and_estimated_whole(traced_layers):
    """The traces at two blocks and three would be as deep as the model: its estimate
    traces it once, at its depth."""
    config = with_mapping(tiny(layers=6, devices=2), Mapping(2, 1, 1, 2, 1, "all_to_all"), 8)
    assert block_count(config) == 3 and screens_shallow(config) and not extrapolates(config)
    cache = estimates.EstimateCache(None)
    plan = tracer.Tracer(["none"], PROFILE, cache)
    plan.screen(config, extrapolate_layers=True)
    tracer.estimate_mapping(config, ["none"], PROFILE, cache, tracer=plan)
    assert traced_layers == [2, 6]


def test_leading_dense_layers_extrapolate_as_the_embedding_does(traced_layers):
    """DeepSeek-V3's shape, small: a leading dense layer, then four MoE blocks of
    multi-head latent attention."""
    args = cli.parse(
        ["plan", "--preset", "deepseek_v3-tiny", "--model.num_layers", "5",
         "--model.d_model", "32", "--model.num_heads", "2", "--model.d_ff", "64",
         "--model.seq_len", "16", "--model.kv_lora_rank", "8", "--model.q_lora_rank", "8",
         "--model.qk_nope_head_dim", "8", "--model.qk_rope_head_dim", "4",
         "--model.v_head_dim", "8", "--moe.num_experts", "8", "--moe.d_expert", "16",
         "--train.batch_size", "8", "--devices", "4", "--profile", PROFILE]
    )  # fmt: skip
    config = with_mapping(cli.resolve_config(args), Mapping(4, 1, 1, 4, 1, "all_to_all"), 8)
    assert block_count(config) == 4
    cache = estimates.EstimateCache(None)
    memory, times = tracer.estimate_mapping(config, ["none"], PROFILE, cache)
    whole_memory, whole_times = tracer.estimate_mapping(
        config, ["none"], PROFILE, cache, extrapolate_layers=False
    )
    assert traced_layers == [3, 4, 5]
    assert memory == whole_memory
    assert times["none"].step == pytest.approx(whole_times["none"].step, rel=1e-9)


def test_the_line_is_drawn_where_the_orders_agree():
    """The shallower of the two depths a schedule's line runs through: the first two
    successive depths, from two blocks on, at which the live-bytes bound withdrew
    placements at both or at neither; no deeper than the model or MAX_TRACED_BLOCKS."""
    assert MAX_TRACED_BLOCKS == 5

    def withdrew_at(*depths):
        return lambda depth: depth in depths

    assert agreeing_depth(withdrew_at(), 56) == 2
    assert agreeing_depth(withdrew_at(2, 3, 4), 56) == 2
    assert agreeing_depth(withdrew_at(2), 56) == 3
    assert agreeing_depth(withdrew_at(3, 4), 56) == 3
    assert agreeing_depth(withdrew_at(2, 4), 56) == 4  # none agree: the deepest allowed
    assert agreeing_depth(withdrew_at(2, 4), 4) == 3  # the model's own depth is the deepest


def test_extrapolate_from_a_further_depth():
    @dataclasses.dataclass(frozen=True)
    class Figures:
        seconds: float

    three, four = Figures(2.0), Figures(2.5)
    assert extrapolate(three, four, 3, shallow_blocks=3) == three
    assert extrapolate(three, four, 7, shallow_blocks=3) == Figures(4.0)


def _stepping_by_depth(
    monkeypatch,
    withdrawn_at: set[int],
    uneven_at: frozenset[int] = frozenset(),
    ops_a_block: int = 0,
) -> list[int]:
    """Steps priced from their depth alone, nothing traced: 1 s and 0.5 s a block, and 1 s
    more at the depths in ``withdrawn_at``, where the live-bytes bound withdrew placements,
    and at those in ``uneven_at``, where it did not; each step ``ops_a_block`` ops a block.
    Returns the depths priced, in order."""
    priced: list[int] = []
    memory = StepMemory(*[1] * 8)

    def traced(config):
        ops = range(ops_a_block * block_count(config))
        return types.SimpleNamespace(
            program=types.SimpleNamespace(ops=ops), run=types.SimpleNamespace(state_shapes=None)
        )

    monkeypatch.setattr(tracer, "trace", traced)
    monkeypatch.setattr(tracer, "step_memory", lambda program, shapes: memory)

    def price(traced, memory, config, schedules, profile):
        depth = block_count(config)
        priced.append(depth)
        seconds = 1.0 + 0.5 * depth + (1.0 if depth in withdrawn_at | uneven_at else 0.0)
        time = estimates.StepTime(seconds, seconds, 0.0, 0.0)
        return (memory, {s: time for s in schedules}), {s: depth in withdrawn_at for s in schedules}

    monkeypatch.setattr(tracer, "_estimate_program", price)
    return priced


@pytest.mark.parametrize(
    ("withdrawn_at", "depths", "step"),
    [(set(), [2, 3], 4.5), ({2}, [2, 3, 4], 4.5), ({3, 4, 5}, [2, 3, 4], 5.5)],
    ids=["never", "at two blocks", "from three blocks"],
)
def test_a_depth_whose_order_is_unlike_the_next_is_not_on_the_line(
    monkeypatch, withdrawn_at, depths, step
):
    """A seven-block model. Where the bound withdraws at two blocks alone, the line through
    two and three blocks would count the withdrawals' cost as a block's saving (0.5 s at
    seven blocks); the line through three and four is the blocks' own. Where it withdraws
    from three blocks on, that line carries the withdrawals' cost."""
    priced = _stepping_by_depth(monkeypatch, withdrawn_at)
    config = with_mapping(tiny(layers=14, devices=2), Mapping(2, 1, 1, 2, 1, "all_to_all"), 8)
    assert block_count(config) == 7
    cache = estimates.EstimateCache(None)
    _, times = tracer.estimate_mapping(config, ["none"], PROFILE, cache)
    assert priced == depths
    assert times["none"].step == pytest.approx(step)


def test_a_paired_line_runs_from_two_blocks_to_eight():
    """``pair`` merges whole passes, so what a block adds settles on average over several
    blocks only: its line runs from the shallower depth to PAIRED_LINE_DEPTH blocks, no
    deeper than the model; every other schedule's to the next depth."""
    assert PAIRED_LINE_DEPTH == 8
    never = lambda depth: False
    assert line_depths("pair", never, 28) == (2, 8)
    assert line_depths("pair", never, 6) == (2, 6)
    assert line_depths("dw", never, 28) == (2, 3)
    assert line_depths("pair", lambda depth: depth == 2, 28) == (3, 8)
    assert line_depths("pair", lambda depth: depth in (2, 4), 28) == (4, 8)


def test_no_line_runs_deeper_than_a_step_of_max_line_ops():
    """The deepest depth is that whose step, on the line through the steps' sizes at two
    blocks and three, has at most MAX_LINE_OPS ops; never shallower than three blocks."""
    assert MAX_LINE_OPS == 150_000
    never = lambda depth: False
    small = lambda depth: 10_000 + 20_000 * depth  # 50,000 ops at two blocks, 150,000 at seven
    assert line_depths("pair", never, 28, small) == (2, 7)
    assert line_depths("pair", never, 6, small) == (2, 6)  # the model is shallower still
    assert line_depths("dw", never, 28, small) == (2, 3)
    large = lambda depth: 40_000 * depth  # a third block would already pass it
    assert line_depths("pair", never, 28, large) == (2, 3)
    assert line_depths("pair", never, 28, lambda depth: 200_000 * depth) == (2, 3)
    # Where the orders disagree up to the deepest depth allowed, the line is the deepest
    # pair within it.
    assert line_depths("dw", lambda depth: depth in (2, 4), 28) == (4, 5)
    assert line_depths("dw", lambda depth: depth in (2, 4), 28, large) == (2, 3)
    assert line_depths("dw", lambda depth: depth in (2, 4), 28, small) == (4, 5)


def test_a_paired_step_is_traced_no_deeper_than_max_line_ops_allow(monkeypatch):
    """A twelve-block model of 30,000 ops a block: at most five blocks within 150,000, so
    the paired line runs through two blocks and five."""
    priced = _stepping_by_depth(monkeypatch, set(), ops_a_block=30_000)
    mapping = Mapping(2, 1, 1, 2, 1, "all_to_all", microbatches=2)
    config = with_mapping(tiny(layers=24, devices=2), mapping, 8)
    _, times = tracer.estimate_mapping(config, ["pair"], PROFILE, estimates.EstimateCache(None))
    assert priced == [2, 3, 5]
    assert times["pair"].step == pytest.approx(1.0 + 0.5 * 12)


def test_extrapolate_along_a_longer_span():
    @dataclasses.dataclass(frozen=True)
    class Figures:
        bytes: int
        seconds: float

    two, eight = Figures(100, 1.5), Figures(161, 4.5)
    assert extrapolate(two, eight, 8, 2, 8) == eight
    deep = extrapolate(two, eight, 28, 2, 8)
    assert deep.seconds == pytest.approx(1.5 + 26 * 0.5)
    assert deep.bytes == round(100 + 26 * 61 / 6)  # rounded, off the one-block grid
    with pytest.raises(ValueError, match="deeper_blocks=2"):
        extrapolate(two, eight, 28, 2, 2)


def test_a_paired_step_is_estimated_from_two_blocks_and_eight(monkeypatch):
    """A twelve-block model whose third block adds 1 s more than the others: the line
    through two and three blocks takes it for every block's (``none``: 17 s), the paired
    line through two and eight for one block's among six (``pair``: 7 s, the trace's own
    slope of 0.5 s a block). Eight blocks are priced under ``pair`` alone."""
    priced = _stepping_by_depth(monkeypatch, set(), frozenset({3}))
    schedules = []
    price = tracer._estimate_program

    def recording(traced, memory, config, asked, profile):
        schedules.append(tuple(asked))
        return price(traced, memory, config, asked, profile)

    monkeypatch.setattr(tracer, "_estimate_program", recording)
    mapping = Mapping(2, 1, 1, 2, 1, "all_to_all", microbatches=2)
    config = with_mapping(tiny(layers=24, devices=2), mapping, 8)
    assert block_count(config) == 12
    _, times = tracer.estimate_mapping(
        config, ["none", "pair"], PROFILE, estimates.EstimateCache(None)
    )
    assert priced == [2, 3, 8]
    assert schedules == [("none", "pair"), ("none", "pair"), ("pair",)]
    assert times["none"].step == pytest.approx(2.0 + 10 * 1.5)
    assert times["pair"].step == pytest.approx(2.0 + 10 * 0.5)
