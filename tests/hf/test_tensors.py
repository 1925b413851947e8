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
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def rules_of(family):
    values = json.loads((FIXTURES / family / "config.json").read_text())
    config = converted_config(read_architecture(values, "config.json"), {})
    trees = abstract_leaves(config)
    return tensor_rules(family, {name: leaf_shapes(tree) for name, tree in trees.items()})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_rules_name_every_tensor_of_the_checkpoint_with_its_shape(family):
    rules = rules_of(family)
    with safe_open(FIXTURES / family / "model.safetensors", "numpy") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118

    assert set(rules) == set(shapes)
    assert {name: rule.hf_shape for name, rule in rules.items()} == shapes
    assert next(iter(rules)) == "model.embed_tokens.weight"  # transformers' order


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
