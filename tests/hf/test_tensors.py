"""The tensor table: which transformers tensor fills which part of which jaxmoe leaf, and
how (transposes and reshapes, exact both ways). Shapes only: no model is built."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from jaxmoe.config import ConfigError
from jaxmoe.hf.architectures import read_architecture
from jaxmoe.hf.convert import abstract_leaves, converted_config
from jaxmoe.hf.tensors import leaf_shapes, tensor_rules

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def rules_of(family):
    values = json.loads((FIXTURES / family / "config.json").read_text())
    architecture = read_architecture(values, "config.json")
    config = converted_config(architecture, {})
    trees = abstract_leaves(config)
    rotary = config.model.rotary_head_dim if architecture.rotary_interleaved else 0
    return tensor_rules(family, {name: leaf_shapes(tree) for name, tree in trees.items()}, rotary)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_rules_name_every_tensor_of_the_checkpoint_with_its_shape(family):
    rules = rules_of(family)
    with safe_open(FIXTURES / family / "model.safetensors", "numpy") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118

    assert set(rules) == set(shapes)
    assert {name: rule.hf_shape for name, rule in rules.items()} == shapes
    assert next(iter(rules)) == "model.embed_tokens.weight"  # transformers' order


def test_deepseek_v3_rows_latent_attention_the_selection_bias_and_the_mtp_layer():
    rules = rules_of("deepseek_v3")  # 3 layers, 4 heads: nope 8, rope 8, value 12

    kv_down = rules["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert (kv_down.path[-2:], kv_down.interleaved) == (("kv_down", "kernel"), 8)
    # Interleaved pairs (x0, y0, x1, y1, ...) become halves (x0, x1, ..., y0, y1, ...).
    weight = np.arange(24 * 32, dtype=np.float32).reshape(24, 32)
    kernel = kv_down.to_jaxmoe(weight)  # [d, kv_lora_rank 16 + rope 8]
    assert kernel[0, :16].tolist() == weight[:16, 0].tolist()  # the latent, unpermuted
    assert kernel[0, 16:].tolist() == weight[[16, 18, 20, 22, 17, 19, 21, 23], 0].tolist()
    query_up = rules["model.layers.1.self_attn.q_b_proj.weight"]
    assert query_up.interleaved == 8 and query_up.part_shape == (16, 4, 16)
    assert rules["model.layers.1.self_attn.kv_b_proj.weight"].interleaved == 0

    bias = rules["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert (bias.collection, bias.kept_float32, bias.block_fp8) == ("model_state", True, False)
    assert not rules["model.layers.1.mlp.gate.weight"].block_fp8  # the router
    assert rules["model.layers.1.mlp.experts.3.up_proj.weight"].block_fp8
    shared = rules["model.layers.1.mlp.shared_experts.down_proj.weight"]
    assert shared.path == ("blocks", 1, "shared", "ffn", "down", "kernel")

    # The MTP module is layer 3: its block as any layer's, its own norms and projection,
    # and copies of the embedding and head that are written, not read.
    assert rules["model.layers.3.self_attn.o_proj.weight"].path[:3] == ("mtp", 0, "block")
    assert rules["model.layers.3.eh_proj.weight"].path == ("mtp", 0, "projection", "kernel")
    assert rules["model.layers.3.shared_head.norm.weight"].path[-2] == "final_norm"
    head = rules["model.layers.3.shared_head.head.weight"]
    assert head.copy and head.path == ("head", "kernel") and not head.block_fp8


@pytest.mark.parametrize("family", FAMILIES)
def test_every_conversion_is_exact_both_ways(family):
    rng = np.random.default_rng(0)
    for name, rule in rules_of(family).items():
        tensor = rng.standard_normal(rule.hf_shape).astype(np.float32)
        part = rule.to_jaxmoe(tensor)
        assert part.shape == rule.part_shape, name
        back = rule.to_hf(part)
        assert back.flags.c_contiguous and back.tobytes() == tensor.tobytes(), name


def test_projections_land_where_jaxmoe_reads_them():
    rules = rules_of("qwen3_moe")  # 4 heads (2 key/value) of 16, width 32, 8 experts of 16
    q = rules["model.layers.0.self_attn.q_proj.weight"]
    weight = np.arange(np.prod(q.hf_shape), dtype=np.float32).reshape(q.hf_shape)
    kernel = q.to_jaxmoe(weight)  # [d, heads, head_dim]
    assert kernel[5, 3, 7] == weight[3 * 16 + 7, 5]

    v = rules["model.layers.0.self_attn.v_proj.weight"]
    assert v.path == ("blocks", 0, "attention", "key_value", "kernel")
    assert v.index == (slice(None), 1)
    up = rules["model.layers.1.mlp.experts.6.up_proj.weight"]
    assert (up.path[-1], up.index, up.part_shape) == ("w_in", (6, slice(None), 1), (32, 16))
    down = rules["model.layers.1.mlp.experts.6.down_proj.weight"]
    assert (down.index, down.hf_shape) == ((6,), (32, 16))
    router = rules["model.layers.1.mlp.gate.weight"]
    assert (router.path[-2:], router.hf_shape) == (("router", "kernel"), (8, 32))


def test_mixtral_and_qwen_name_their_experts_their_own_way():
    mixtral, qwen2 = rules_of("mixtral"), rules_of("qwen2_moe")
    assert rules_of("mixtral")["model.layers.1.block_sparse_moe.experts.7.w3.weight"].index == (
        7,
        slice(None),
        1,
    )
    assert "model.layers.1.block_sparse_moe.gate.weight" in mixtral
    assert qwen2["model.layers.1.mlp.shared_expert_gate.weight"].path[-2:] == ("gate", "kernel")
    assert "model.layers.0.mlp.gate_proj.weight" in qwen2  # the leading dense layer
    assert "lm_head.weight" not in qwen2  # tied to the embedding


def test_a_jaxmoe_leaf_without_a_row_is_refused_by_name():
    leaves = {
        "params": {("final_norm", "scale"): (32,)},
        "model_state": {("blocks", 1, "ffn", "router", "expert_bias"): (8,)},
    }
    with pytest.raises(ConfigError) as error:
        tensor_rules("mixtral", leaves)
    assert "model_state leaf blocks.1.ffn.router.expert_bias has no transformers tensor" in str(
        error.value
    )
