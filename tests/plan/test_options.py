"""The options a mapping adds to its layout (jaxmoe/plan/options.py)."""

from __future__ import annotations

from jaxmoe.config import Config, ModelConfig, ParallelConfig, TrainConfig
from jaxmoe.config.choices import RECOMPUTE
from jaxmoe.config.train import ZERO_STAGES
from jaxmoe.plan.options import (
    Options,
    bounding,
    least_memory,
    option_sets,
    options_of,
    recompute_chains,
)


def _config(batch: int = 16) -> Config:
    return Config(
        model=ModelConfig(num_layers=2, num_heads=2, d_model=32, d_ff=64, seq_len=16),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=batch),
    )


def test_every_stage_recomputation_and_divisor_of_the_rows():
    config = _config()  # 8 batch shards: 2 rows each
    sets = option_sets(config)
    assert {o.microbatches for o in sets} == {1, 2}
    # The default (flash) attention core: no core recomputation to choose; the matmuls'
    # results kept, or nothing but the blocks' inputs.
    assert {o.recompute for o in sets} == {"none", "matmuls", "layer"}
    assert len(sets) == len(ZERO_STAGES) * 3 * 2
    assert {o.microbatches for o in option_sets(config, microbatches=False)} == {1}
    assert options_of(config) == Options()


def test_least_memory_and_the_traced_set():
    sets = option_sets(_config())
    assert least_memory(sets) == Options(3, RECOMPUTE[-1], 1)
    # The bounds come from ZeRO-1: a fully sharded block keeps every value it makes.
    assert bounding(sets) == Options(1, RECOMPUTE[-1], 1)
    assert bounding([Options(0, "none", 2), Options(3, "none", 2)]) == Options(0, "none", 2)
    assert Options(3, "layer", 2).label() == "ZeRO-3, recompute layer, microbatches 2"


def test_each_stage_and_microbatch_count_recomputes_least_first():
    sets = option_sets(_config())
    chains = recompute_chains(list(reversed(sets)))
    assert len(chains) == len(ZERO_STAGES) * 2
    assert {o for chain in chains for o in chain} == set(sets)
    assert sum(len(chain) for chain in chains) == len(sets)
    for chain in chains:
        assert len({(o.zero, o.microbatches) for o in chain}) == 1
        assert [o.recompute for o in chain] == ["none", "matmuls", "layer"]
