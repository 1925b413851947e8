"""The routing fields of the MoE section, and routing groups under tensor parallelism."""

import pytest

from jaxmoe.config import (
    Config,
    ConfigError,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_expert_groups": 3}, r"moe.num_expert_groups=3 does not divide moe.num_experts=8"),
        ({"num_expert_groups": 0}, r"moe.num_expert_groups=0"),
        (
            {"num_expert_groups": 4, "top_k_expert_groups": 5},
            r"moe.top_k_expert_groups=5 is more than the moe.num_expert_groups=4",
        ),
        (
            {"num_expert_groups": 4, "top_k_expert_groups": 1, "top_k": 3},
            r"moe.top_k=3 is more than the 1 x 2 experts",
        ),
        ({"routed_scaling_factor": 0.0}, r"moe.routed_scaling_factor=0.0: must be > 0"),
        ({"expert_bias_rate": -0.001}, r"moe.expert_bias_rate"),
        ({"seq_aux_loss_coef": -1.0}, r"moe.seq_aux_loss_coef"),
    ],
)
def test_routing_fields_are_checked(fields, message):
    with pytest.raises(ConfigError, match=message):
        MoEConfig(num_experts=8, **{"top_k": 2, **fields})


def test_deepseek_v3_routing_is_a_valid_section():
    moe = MoEConfig(
        num_experts=256,
        top_k=8,
        score_function="sigmoid",
        routed_scaling_factor=2.5,
        num_expert_groups=8,
        top_k_expert_groups=4,
        expert_bias_rate=0.001,
        seq_aux_loss_coef=1e-4,
    )
    assert moe.top_k_expert_groups == 4


def config(tensor: int, group_size: int | None, batch_size: int = 16) -> Config:
    return Config(
        model=ModelConfig(d_model=32, num_heads=4, num_layers=2, d_ff=64, seq_len=16),
        moe=MoEConfig(num_experts=8, top_k=2, group_size=group_size),
        parallel=ParallelConfig(data=2, expert=4, tensor=tensor),
        train=TrainConfig(batch_size=batch_size),
    )


def test_the_default_routing_group_is_one_sequence_in_every_layout():
    for tensor in (1, 2, 4):
        assert config(tensor, None).group_size == 16


@pytest.mark.parametrize(
    ("tensor", "group_size"),
    [(2, 8), (2, 4), (4, 4), (2, 16), (2, 32), (4, 64)],
    ids=["slice", "in-slice", "slice-t4", "sequence", "two-rows", "four-rows"],
)
def test_groups_inside_a_slice_or_of_whole_rows_are_accepted(tensor, group_size):
    assert config(tensor, group_size).group_size == group_size


@pytest.mark.parametrize(
    ("tensor", "group_size", "batch_size"),
    [(2, 12, 16), (2, 24, 16), (2, 48, 16), (4, 8, 16)],
    ids=["straddles-slices", "not-whole-rows", "rows-do-not-divide", "larger-than-slice-t4"],
)
def test_groups_that_are_neither_are_refused_naming_the_fields(tensor, group_size, batch_size):
    with pytest.raises(
        ConfigError, match=rf"moe.group_size={group_size}: under parallel.tensor={tensor}"
    ):
        config(tensor, group_size, batch_size)
