"""The pipeline's tick table: every microbatch through every chunk once each way, in
dependency order, one slot per stage and tick, and the bubble and memory it states."""

import itertools

import pytest

from jaxmoe.pipeline.ticks import TickTable, chunk_layers

SHAPES = [(2, 1, 4), (2, 2, 4), (4, 1, 8), (4, 2, 8), (2, 2, 3), (3, 1, 1), (4, 3, 5)]


def _slots(schedule: TickTable, kind: str) -> dict[tuple[int, int], int]:
    """``(microbatch, chunk) -> tick`` of every forward (or backward) slot."""
    found = {}
    for tick in schedule.ticks:
        for stage, slot in enumerate(getattr(tick, kind)):
            if slot is not None:
                key = (slot.microbatch, schedule.chunk(stage, slot.virtual))
                assert key not in found, f"{kind} of {key} twice"
                found[key] = tick.index
    return found


@pytest.mark.parametrize(("stages", "virtual", "microbatches"), SHAPES)
def test_each_microbatch_runs_every_chunk_once_each_way_in_order(stages, virtual, microbatches):
    schedule = TickTable(stages, virtual, microbatches)
    forward, backward = _slots(schedule, "forward"), _slots(schedule, "backward")
    chunks = stages * virtual
    expected = set(itertools.product(range(microbatches), range(chunks)))
    assert set(forward) == set(backward) == expected
    for m in range(microbatches):
        for c in range(chunks - 1):
            # The next chunk runs in the tick after, backward the other way round.
            assert forward[m, c + 1] == forward[m, c] + 1
            assert backward[m, c] == backward[m, c + 1] + 1
        # The loss's gradient starts the backward pass in the tick of the last forward.
        assert backward[m, chunks - 1] == forward[m, chunks - 1]
        for c in range(chunks):
            assert backward[m, c] - forward[m, c] == schedule.distance(c)


@pytest.mark.parametrize(("stages", "virtual", "microbatches"), SHAPES)
def test_microbatches_enter_in_order_and_the_first_stage_runs_chunk_zero(
    stages, virtual, microbatches
):
    schedule = TickTable(stages, virtual, microbatches)
    forward = _slots(schedule, "forward")
    entries = [forward[m, 0] for m in range(microbatches)]
    assert entries == sorted(entries) and entries[0] == 0
    for tick in schedule.ticks:
        for stage, slot in enumerate(tick.forward):
            if slot is not None and schedule.chunk(stage, slot.virtual) == 0:
                assert stage == 0


@pytest.mark.parametrize(
    ("stages", "virtual", "microbatches"), [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8), (4, 4, 8)]
)
def test_the_bubble_is_megatrons_when_the_stages_divide_the_microbatches(
    stages, virtual, microbatches
):
    schedule = TickTable(stages, virtual, microbatches)
    # P - 1 chunk ticks of forward (and of backward) beyond each stage's own M x V.
    assert schedule.bubble_chunk_ticks == stages - 1
    assert schedule.busy_forward_ticks == microbatches * virtual + stages - 1
    assert schedule.busy_backward_ticks == schedule.busy_forward_ticks
    assert schedule.bubble_fraction == pytest.approx(
        (stages - 1) / (microbatches * virtual + stages - 1)
    )
    # Warm-up ticks are forward-only, cool-down ticks backward-only.
    assert not schedule.ticks[0].has_backward and not schedule.ticks[-1].has_forward


@pytest.mark.parametrize(("stages", "virtual", "microbatches"), SHAPES)
def test_a_device_holds_the_residuals_of_at_most_two_rounds_of_chunks(
    stages, virtual, microbatches
):
    schedule = TickTable(stages, virtual, microbatches)
    chunks = stages * virtual
    assert schedule.residuals_held <= 2 * chunks - 1
    if virtual == 1 and microbatches >= stages:  # 1F1B with every stage busy
        assert schedule.residuals_held == 2 * chunks - 1
    # 1F1B over two stages and four microbatches: before tick 2's backward slot (the first
    # microbatch's on chunk 0) the forward slots of ticks 0, 1 and 2 are held.
    assert TickTable(2, 1, 4).residuals_held == 3


def test_one_microbatch_on_one_stage_is_the_plain_step():
    (tick,) = TickTable(1, 1, 1).ticks
    assert tick.forward == tick.backward and tick.forward[0].microbatch == 0


def test_layers_split_into_equal_chunks_or_not_at_all():
    assert chunk_layers(8, 2, 2) == 2
    with pytest.raises(ValueError, match="6 layers do not split into 4 equal chunks"):
        chunk_layers(6, 2, 2)
    with pytest.raises(ValueError, match="stages=0"):
        TickTable(0, 1, 1)
