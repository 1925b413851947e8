"""The model FLOPs count: a hand count, how it scales, and the traced train step's matmuls."""

import dataclasses
import math

import pytest

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.plan.model_flops import model_flops
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step
from scheduling import op_flops


def tiny(**moe_fields) -> Config:
    """Width 8, 2 heads, 2 layers (layer 1 is the MoE layer), sequence 4, 8 sequences."""
    return Config(
        model=ModelConfig(vocab_size=256, d_model=8, num_heads=2, num_layers=2, d_ff=16, seq_len=4),
        moe=MoEConfig(**{"num_experts": 4, "top_k": 2, **moe_fields}),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=8),
    )


def replace(config: Config, section: str, **fields) -> Config:
    return dataclasses.replace(
        config, **{section: dataclasses.replace(getattr(config, section), **fields)}
    )


def test_a_hand_count_of_every_matmul():
    tokens = 8 * 4

    def matmul(m: int, k: int, n: int) -> int:
        return 2 * m * k * n

    # Per layer: qkv [32, 8] @ [8, 24] and out [32, 8] @ [8, 8]; per sequence and head,
    # scores [4, 4] @ [4, 4] and weights x values [4, 4] @ [4, 4].
    attention_projections = 2 * (matmul(tokens, 8, 24) + matmul(tokens, 8, 8))
    attention_matmuls = 2 * 8 * 2 * (matmul(4, 4, 4) + matmul(4, 4, 4))
    dense_ffn = matmul(tokens, 8, 16) + matmul(tokens, 16, 8)  # layer 0 only
    router = matmul(tokens, 8, 4)
    # Each token through 2 experts of width 16: 64 rows, whatever the capacity.
    experts = matmul(2 * tokens, 8, 16) + matmul(2 * tokens, 16, 8)
    output_head = matmul(tokens, 8, 256)

    flops = model_flops(tiny())

    assert (
        flops.attention_projections,
        flops.attention_matmuls,
        flops.dense_ffn,
        flops.router,
        flops.experts,
        flops.output_head,
    ) == (attention_projections, attention_matmuls, dense_ffn, router, experts, output_head)
    total = attention_projections + attention_matmuls + dense_ffn + router + experts + output_head
    assert flops.forward == total
    assert flops.train_step() == 3 * total


def test_doubling_top_k_adds_exactly_the_expert_flops():
    one, two = model_flops(tiny(top_k=1)), model_flops(tiny(top_k=2))
    assert two.experts == 2 * one.experts
    assert two.train_step() - one.train_step() == 3 * one.experts
    assert dataclasses.replace(two, experts=one.experts) == one


def test_scaling_with_batch_sequence_and_expert_width():
    base = tiny()
    flops = model_flops(base)
    doubled_batch = model_flops(replace(base, "train", batch_size=16))
    assert doubled_batch.forward == 2 * flops.forward
    # Twice the sequence: twice the tokens, and each attends to twice as many positions.
    longer = model_flops(replace(base, "model", seq_len=8))
    assert longer.attention_matmuls == 4 * flops.attention_matmuls
    assert longer.forward - longer.attention_matmuls == 2 * (
        flops.forward - flops.attention_matmuls
    )
    wider_experts = model_flops(replace(base, "moe", d_expert=32))
    assert wider_experts.experts == 2 * flops.experts
    assert wider_experts.forward - wider_experts.experts == flops.forward - flops.experts


def test_padding_layout_and_drops():
    flops = model_flops(tiny())
    # Capacity padding, dropless buffers and the layout are not model FLOPs.
    for other in (
        tiny(capacity_factor=4.0),
        tiny(capacity_factor=None),
        replace(tiny(), "parallel", data=4, expert=2),
    ):
        assert model_flops(other) == flops
    # Dropped assignments are not computed: a quarter dropped removes a quarter of the
    # experts' forward and backward work.
    assert flops.train_step(0.25) == flops.train_step() - 3 * 0.25 * flops.experts
    with pytest.raises(ValueError, match=r"dropped_fraction=1\.5"):
        flops.train_step(1.5)


def traced_matmul_flops(config: Config) -> float:
    """Matmul FLOPs of the whole train step as traced: per device, times the devices
    (every device computes distinct tokens and its own experts' slots). The configurations
    use the dense attention core, which computes what the count counts; a flash core's
    backward pass computes the scores once more."""
    mesh = build_mesh(config.parallel)
    program, _ = capture_train_step(resolve(config, mesh))
    per_device = sum(op_flops(op) for op in program.ops if op.primitive == "dot_general")
    return per_device * mesh.devices.size


def combine_flops(config: Config) -> int:
    """The weighted sum of each token's top_k expert outputs, forward and backward: a
    matmul in the program, not model FLOPs."""
    tokens = config.train.batch_size * config.model.seq_len
    per_layer = 2 * tokens * config.moe.top_k * config.model.d_model
    return 3 * per_layer * len(config.model.moe_layers)


@pytest.mark.parametrize(("data", "expert"), [(2, 4), (8, 1)])
def test_the_traced_step_computes_the_count_where_capacity_has_no_padding(data, expert):
    # 8 experts, top 2, groups of 8 tokens, capacity factor 1: 2 slots per expert, so the
    # 16 slots of a group are exactly its 16 assignments.
    config = Config(
        model=ModelConfig(
            vocab_size=256,
            d_model=16,
            num_heads=2,
            num_layers=2,
            d_ff=32,
            seq_len=8,
            attention="dense",
        ),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        parallel=ParallelConfig(data=data, expert=expert),
        train=TrainConfig(batch_size=16),
    )
    assert config.capacity_per_expert * config.moe.num_experts == config.group_size * 2
    flops = model_flops(config)
    assert math.isclose(
        traced_matmul_flops(config), flops.train_step() + combine_flops(config), rel_tol=1e-12
    )
    # Twice the capacity: the expert GEMMs run over twice the slots, half of them empty.
    padded = replace(config, "moe", capacity_factor=2.0)
    assert model_flops(padded) == flops
    assert math.isclose(
        traced_matmul_flops(padded) - traced_matmul_flops(config),
        3 * flops.experts,
        rel_tol=1e-12,
    )


def test_the_traced_step_of_the_llama_blocks_computes_the_count():
    # Grouped-query attention with a head width of its own, SwiGLU (three matrices), a gated
    # shared expert and an untied head; no capacity padding (8 experts, top 2, factor 1).
    config = Config(
        model=ModelConfig(
            vocab_size=256, d_model=16, num_heads=4, num_kv_heads=2, head_dim=8,
            num_layers=2, d_ff=32, seq_len=8, norm="rmsnorm", position="rope",
            activation="swiglu", linear_bias=False, tie_embeddings=False, attention="dense",
        ),
        moe=MoEConfig(
            num_experts=8, top_k=2, capacity_factor=1.0, d_expert=8, num_shared_experts=2,
            shared_expert_gate=True,
        ),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=16),
    )  # fmt: skip
    flops = model_flops(config)
    tokens = 16 * 8
    assert flops.attention_projections == 2 * (
        2 * tokens * 16 * (32 + 2 * 16) + 2 * tokens * 32 * 16
    )
    assert flops.experts == 3 * 2 * (2 * tokens) * 16 * 8  # one MoE layer, three matrices
    assert flops.shared_experts == 3 * 2 * tokens * 16 * 16
    assert math.isclose(
        traced_matmul_flops(config), flops.train_step() + combine_flops(config), rel_tol=1e-12
    )


@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_the_traced_step_of_latent_attention_computes_the_count(q_lora_rank):
    # Multi-head latent attention: queries through a compression or straight from the
    # residual stream, keys and values from one latent, a value width of its own.
    config = Config(
        model=ModelConfig(
            vocab_size=256, d_model=16, num_heads=4, num_layers=2, d_ff=32, seq_len=8,
            norm="rmsnorm", position="rope", activation="swiglu", linear_bias=False,
            tie_embeddings=False, attention="dense", kv_lora_rank=12, q_lora_rank=q_lora_rank,
            qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        ),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0, d_expert=8),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=16),
    )  # fmt: skip
    flops = model_flops(config)
    tokens = 16 * 8
    queries = 16 * 4 * 10 if q_lora_rank is None else 16 * 8 + 8 * 4 * 10
    per_token = queries + 16 * (12 + 4) + 12 * 4 * (6 + 5) + 4 * 5 * 16
    assert flops.attention_projections == 2 * 2 * tokens * per_token
    assert flops.attention_matmuls == 2 * (2 * tokens * 4 * (10 + 5) * 8)
    assert math.isclose(
        traced_matmul_flops(config), flops.train_step() + combine_flops(config), rel_tol=1e-12
    )


def test_the_traced_step_of_multi_token_prediction_computes_the_count():
    # Two modules after two layers; the second module's block is an MoE block.
    config = Config(
        model=ModelConfig(
            vocab_size=256, d_model=16, num_heads=2, num_layers=2, d_ff=32, seq_len=8,
            moe_every=2, attention="dense", mtp_depth=2,
        ),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=16),
    )  # fmt: skip
    assert config.model.moe_layers == (1, 3)
    flops = model_flops(config)
    tokens = 16 * 8
    assert flops.multi_token_projections == 2 * 2 * tokens * 32 * 16
    assert flops.output_head == 3 * 2 * tokens * 16 * 256
    assert math.isclose(
        traced_matmul_flops(config), flops.train_step() + combine_flops(config), rel_tol=1e-12
    )
