"""Which passes the pair schedule runs side by side: every pass once, none alone, each
backward pass after its own forward pass."""

import pytest

from scheduling.passes.pair_microbatches import pass_pairs
from scheduling.program.capture import Phase

F, B = Phase.FORWARD, Phase.BACKWARD


def test_two_and_four_microbatches():
    assert pass_pairs(1) == []
    assert pass_pairs(2) == [((0, F), (1, F)), ((0, B), (1, B))]
    assert pass_pairs(4) == [
        ((0, F), (1, F)),
        ((0, B), (2, F)),
        ((1, B), (3, F)),
        ((2, B), (3, B)),
    ]


@pytest.mark.parametrize("count", [2, 3, 5, 8])
def test_every_pass_once_and_after_its_forward(count):
    pairs = pass_pairs(count)
    passes = [p for pair in pairs for p in pair]
    assert len(passes) == len(set(passes)) == 2 * count
    assert set(passes) == {(i, phase) for i in range(count) for phase in (F, B)}
    at = {p: n for n, pair in enumerate(pairs) for p in pair}
    assert all(at[i, F] < at[i, B] for i in range(count))
