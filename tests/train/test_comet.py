"""The train step with MoE exchanges decomposed (schedules ``comet`` and ``lancet+comet``)
computes what the plain one computes.

Per-source rounds and chunks of the slots only move data around the same
arithmetic: each op of the expert computation runs on fewer rows, the weight
and bias gradients run once on the reassembled values, and routing (hence
which tokens are dropped) happens before the exchange, so dropped tokens are
compared exactly. But XLA:CPU compiles the pieces differently from the whole:
a GEMM's blocking of the contracted axis depends on its row count, and the
elementwise work around the pieces is fused (and contracted into FMAs)
differently. Values then move by a few ulps from the second or third step on
(the toy layer in ``tests/scheduling/passes/test_exchange.py`` is bit for bit), so
the partitioned step's tolerances apply (``tests/train/test_partitioned.py``).
"""

import pytest

from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import ConfigError, MoEConfig, ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.presets import preset
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import scheduled_train_step
from scheduling import ExperimentalOptions
from tests.train.runs import with_schedule
from tests.train.test_partitioned import assert_same_training
from tests.train.test_scheduled import run, small


def forced(exchange: str | None) -> ExperimentalOptions:
    """Every exchange decomposed as ``exchange`` (a research option), to check each."""
    return ExperimentalOptions(exchange=exchange)


# Slow: comet's exchanges decomposed in rounds (and in chunks) train like none over five steps
# on the folded layouts by default (tests/train/test_folded_schedules.py).
@pytest.mark.slow
def test_comet_trains_like_none_over_five_steps():
    moe = MoEConfig(8, top_k=2, capacity_factor=1.0)
    config = small(ParallelConfig(2, 4), moe, layers=2, moe_every=1)
    reference = run(with_schedule(config, "none"), steps=5)
    assert any(m["dropped_fraction"] > 0 for m in reference[0])
    result = run(with_schedule(config, "comet"), steps=5, experimental=forced("rounds:4"))
    assert_same_training(result, reference)


@pytest.mark.parametrize(
    ("mesh", "moe", "schedule", "exchange"),
    [
        pytest.param(  # chunks also decompose the folded exchange (test_folded_schedules)
            (4, 2),
            MoEConfig(4, top_k=1, capacity_factor=None),
            "comet",
            "chunks:2",
            marks=pytest.mark.slow,
        ),
        pytest.param(  # lancet+comet also runs on every family and with pairing
            (2, 4),
            MoEConfig(8, top_k=2, capacity_factor=None),
            "lancet+comet",
            "rounds:4",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["4x2-top1-dropless-chunks", "2x4-top2-dropless-lancet+comet"],
)
def test_other_layouts_and_lancet_comet_train_like_none(mesh, moe, schedule, exchange):
    config = small(ParallelConfig(*mesh), moe, layers=2, moe_every=1)
    reference = run(with_schedule(config, "none"), steps=2)
    result = run(with_schedule(config, schedule), steps=2, experimental=forced(exchange))
    assert_same_training(result, reference)


def test_report_gives_every_moe_layer_its_decomposition():
    config = with_schedule(preset("tiny"), "comet")
    report = scheduled_train_step(resolve(config, build_mesh(config.parallel))).report
    moe_layers = {c.layer for c in report.collectives if c.kind == "all_to_all"}
    assert {x.layer for x in report.exchanges} == moe_layers
    for layer in report.exchanges:
        assert layer.phases == ["forward", "backward"]
        assert layer.candidates and (layer.decomposition != "none" or layer.why)
    table = report.table()
    assert all(f"MoE layer {layer}" in table for layer in moe_layers)


def test_the_forced_exchange_is_checked():
    with pytest.raises(ValueError, match="rounds:G"):
        forced("rounds")
    config = with_schedule(preset("tiny"), "dw")
    with pytest.raises(ValueError, match="applies to the comet and lancet"):
        scheduled_train_step(resolve(config, build_mesh(config.parallel)), forced("chunks:2"))


def test_schedule_exchange_is_no_setting():
    with pytest.raises(ConfigError, match=r"schedule\.exchange.*ExperimentalOptions"):
        config_from_train_args(["--schedule", "comet", "--schedule.exchange", "rounds:8"])
