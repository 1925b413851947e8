"""The mapping space of ``jaxmoe plan``: every layout of N devices, validated by Config."""

from __future__ import annotations

import dataclasses
import math

import pytest

from jaxmoe.config import Config, ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.plan.mappings import Mapping, context_degrees, enumerate_mappings
from jaxmoe.presets import preset


def test_eight_devices_of_the_tiny_preset():
    tiny = preset("tiny")  # 4 heads, 8 experts, batch 32, sequence 64
    space = enumerate_mappings(tiny, 8)
    # tensor in {1, 2, 4, 8}, data x expert x expert_tensor = 8 in 10 ways, 2 dispatchers:
    # 80 candidates. tensor 8 does not divide the 4 heads (20); without an expert group
    # (1 layout per valid tensor) all_gather is all_to_all's program (3).
    assert (len(space.valid), len(space.skipped)) == (57, 23)
    valid = {c.mapping for c in space.valid}
    assert Mapping(8, 1, 1, 8, 1, "all_to_all") in valid  # the preset's own layout
    assert Mapping(8, 2, 2, 2, 2, "all_gather") in valid  # folded: every axis split
    assert Mapping(8, 4, 1, 2, 4, "all_to_all") in valid
    reasons = {c.mapping: c.reason for c in space.skipped}
    assert (
        "model.num_heads=4 is not divisible by parallel.tensor=8"
        in reasons[Mapping(8, 8, 1, 8, 1, "all_to_all")]
    )
    assert reasons[Mapping(8, 2, 8, 1, 1, "all_gather")].startswith("no expert group")
    summary = space.skipped_summary()
    assert summary[0].startswith("20 x model.num_heads=4")
    assert summary[1].startswith("3 x no expert group")


def test_every_valid_mapping_keeps_the_model_and_the_global_batch():
    tiny = preset("tiny")
    for candidate in enumerate_mappings(tiny, 8).valid:
        config, mapping = candidate.config, candidate.mapping
        assert config.model == tiny.model
        assert config.train.batch_size == tiny.train.batch_size
        assert config.parallel == ParallelConfig(
            data=mapping.expert_data,
            expert=mapping.expert,
            tensor=mapping.tensor,
            expert_tensor=mapping.expert_tensor,
        )
        assert config.moe.dispatcher == mapping.dispatcher
        assert config.parallel.batch_shards == mapping.attention_data


def test_context_degrees_are_tried_where_chunks_hold_enough_positions():
    tiny = preset("tiny")
    assert context_degrees(tiny, 8) == [1]  # rows of 64 positions
    long = dataclasses.replace(tiny, model=dataclasses.replace(tiny.model, seq_len=32768))
    assert context_degrees(long, 128) == [1, 2, 4, 8]  # chunks of 8192 .. 2048
    space = enumerate_mappings(long, 8, contexts=(1, 2))
    valid = {c.mapping for c in space.valid}
    ring = Mapping(8, 2, 1, 8, 1, "all_to_all", context=2, context_exchange="ring")
    gathered = dataclasses.replace(ring, context_exchange="all_gather")
    assert {ring, gathered} <= valid
    assert ring.attention_data == 2
    assert ring.label().startswith("attention 2x2x2 ring, MoE 1x8x1")
    assert gathered.label().startswith("attention 2x2x2 ag, MoE 1x8x1")
    config = next(c.config for c in space.valid if c.mapping == gathered)
    assert (config.parallel.context, config.parallel.context_exchange) == (2, "all_gather")
    assert config.parallel.batch_shards == gathered.attention_data
    # Context degree 1 has one exchange: the same program either way.
    assert not any(
        c.mapping.context == 1 and c.mapping.context_exchange != "ring" for c in space.valid
    )


def test_layouts_that_do_not_fold_are_skipped_with_the_reason():
    # 6 devices: tensor 2 and expert_tensor 3 are both valid widths, but 2 does not divide
    # 3, so the tensor group is not a set of mesh axes of the MoE layout.
    config = Config(
        model=ModelConfig(d_model=36, num_heads=6, num_layers=2, d_ff=96, seq_len=12),
        moe=MoEConfig(num_experts=6),
        parallel=ParallelConfig(data=1, expert=1),
        train=TrainConfig(batch_size=6),
    )
    space = enumerate_mappings(config, 6)
    reasons = {c.mapping: c.reason for c in space.skipped}
    assert "does not fold" in reasons[Mapping(6, 2, 2, 1, 3, "all_to_all")]
    assert "does not fold" in reasons[Mapping(6, 3, 1, 3, 2, "all_to_all")]  # 2 into 3
    valid = {c.mapping for c in space.valid}
    assert Mapping(6, 2, 1, 1, 6, "all_gather") in valid  # tensor 2 inside expert_tensor 6
    assert Mapping(6, 3, 1, 2, 3, "all_to_all") in valid  # tensor 3 = expert_tensor 3


def test_gradient_sync_hosts_follow_the_modelled_nodes():
    for candidate in enumerate_mappings(preset("tiny"), 4, devices_per_host=8).valid:
        assert candidate.config.train.grad_sync_devices_per_host == math.gcd(4, 8)


@pytest.mark.parametrize("devices", [0, -8])
def test_device_count_must_be_positive(devices):
    with pytest.raises(ConfigError, match="positive"):
        enumerate_mappings(preset("tiny"), devices)
