"""config.json <-> jaxmoe configuration: the published models map onto the family presets,
the written config.json reads back to the same model, and what jaxmoe cannot compute the
same way is refused in one line naming the field. No model is built here."""

import dataclasses
import math

import pytest

from jaxmoe.config import Config, ConfigError, ModelConfig, MoEConfig
from jaxmoe.hf.architectures import read_architecture
from jaxmoe.hf.convert import converted_config
from jaxmoe.hf.hf_config import check_expressible, hf_config
from jaxmoe.presets import preset

# The hub's config.json files (transformers 4 format: rope_theta and rope_scaling), the
# fields that shape the model.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}
QWEN2_57B = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "moe_intermediate_size": 2560,
    "norm_topk_prob": False,
    "num_attention_heads": 28,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "shared_expert_intermediate_size": 20480,
    "sliding_window": 65536,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
PUBLISHED = [
    (MIXTRAL_8X7B, "mixtral-8x7b"),
    (QWEN2_57B, "qwen2_moe-57b-a14b"),
    (QWEN3_30B, "qwen3_moe-30b-a3b"),
    (DEEPSEEK_V3, "deepseek_v3-671b"),
]
# What a preset leaves to training: the sequence, the compute dtype, dropping, the
# unused width of the dense FFN in a model without dense layers.
TRAINING_FIELDS = {"seq_len", "dtype", "capacity_factor", "d_ff"}


def read(values, **changes):
    return read_architecture({**values, **changes}, "config.json")


def config_of(values, **overrides):
    return converted_config(read(values), overrides)


def differing(a, b):
    return {
        f.name: (getattr(a, f.name), getattr(b, f.name))
        for f in dataclasses.fields(a)
        if getattr(a, f.name) != getattr(b, f.name) and f.name not in TRAINING_FIELDS
    }


@pytest.mark.parametrize(("values", "name"), PUBLISHED)
def test_a_published_config_is_its_family_preset(values, name):
    config = config_of(values)
    expected = preset(name)

    assert differing(config.model, expected.model) == {}
    assert differing(config.moe, expected.moe) == {}
    assert config.moe.capacity_factor is None  # transformers' models are dropless
    assert config.model.seq_len == 4096  # the context, capped
    assert config.parallel.num_devices == 1  # the checkpoint restores into any layout


@pytest.mark.parametrize(("values", "name"), PUBLISHED)
def test_the_written_config_reads_back_to_the_same_model(values, name):
    config = config_of(values)
    family = values["model_type"]

    block = read(values).fp8_block

    written = hf_config(config, family, "bfloat16", base=None, fp8_block=block)
    again = config_of(written)

    assert again.model == config.model and again.moe == config.moe
    rebased = hf_config(config, family, "bfloat16", base=values, fp8_block=block)
    assert rebased == dict(sorted(values.items())) | {"torch_dtype": "bfloat16"}


def test_deepseek_v3_maps_its_latent_attention_router_mtp_and_fp8_blocks():
    architecture = read(DEEPSEEK_V3)
    model = config_of(DEEPSEEK_V3).model

    assert architecture.family == "deepseek_v3" and architecture.fp8_block == (128, 128)
    assert architecture.rotary_interleaved  # transformers' default for rope_interleave
    assert (model.kv_lora_rank, model.q_lora_rank, model.v_head_dim) == (512, 1536, 128)
    assert (model.rope_mscale, model.rope_mscale_all_dim, model.mtp_depth) == (1.0, 1.0, 1)
    assert not read({**DEEPSEEK_V3, "rope_interleave": False}).rotary_interleaved
    # Queries straight from the residual stream (DeepSeek-V2-Lite's shape of V3).
    assert config_of({**DEEPSEEK_V3, "q_lora_rank": None}).model.q_lora_rank is None
    # MTP modules: as many as the file stores, or fewer (--model.mtp_depth 0 leaves them).
    assert config_of(DEEPSEEK_V3, **{"model.mtp_depth": 0}).model.mtp_depth == 0


def test_kimi_k2_converts_as_deepseek_v3_and_keeps_its_name():
    kimi = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384}
    kimi |= {"num_attention_heads": 64, "num_key_value_heads": 64, "n_group": 1, "topk_group": 1}

    config = config_of(kimi)

    assert read(kimi).family == "deepseek_v3"
    assert (config.moe.num_experts, config.model.num_heads) == (384, 64)
    written = hf_config(config, "deepseek_v3", "bfloat16", base=kimi, fp8_block=(128, 128))
    assert written["model_type"] == "kimi_k2"
    assert written["architectures"] == ["DeepseekV3ForCausalLM"]


def test_transformers_5_rope_parameters_and_expert_count_are_read():
    values = {
        **QWEN3_30B,
        "num_local_experts": 128,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 5e5,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    }
    del values["num_experts"], values["rope_theta"], values["rope_scaling"]

    model = config_of(values).model

    assert (model.rope_theta, model.rope_scaling) == (5e5, "yarn")
    assert (model.rope_scaling_factor, model.rope_original_seq_len) == (4.0, 32768)
    assert config_of(values).moe.num_experts == 128


def test_linear_scaling_and_leading_dense_layers_map_to_their_fields():
    values = {
        **QWEN2_57B,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "mlp_only_layers": [0, 1],
        "decoder_sparse_step": 2,
    }

    model = config_of(values).model

    assert (model.rope_scaling, model.rope_scaling_factor) == ("linear", 2.0)
    assert (model.first_dense_layers, model.moe_every) == (2, 2)
    assert model.d_ff == QWEN2_57B["intermediate_size"]  # the dense layers' width
    assert model.moe_layers == tuple(i for i in range(2, 28) if (i + 1) % 2 == 0)


def test_yarn_constants_that_jaxmoe_shares_are_accepted():
    factor = 4.0
    scaling = {"rope_type": "yarn", "factor": factor, "beta_fast": 32, "beta_slow": 1}
    values = {**QWEN3_30B, "rope_scaling": scaling}
    assert config_of(values).model.rope_scaling == "yarn"
    values["rope_scaling"] = {**scaling, "attention_factor": 0.1 * math.log(factor) + 1}
    assert config_of(values).model.rope_original_seq_len == QWEN3_30B["max_position_embeddings"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(model_type="llama"), "model_type='llama' is not supported: jaxmoe converts"),
        (dict(model_type="deepseek_v2"), "its router (softmax scores"),
        (dict(architectures=["MixtralForSequenceClassification"]), "the causal language model"),
        (dict(hidden_act="gelu"), "hidden_act='gelu': jaxmoe's SwiGLU"),
        (dict(num_hidden_layers=None), "num_hidden_layers is missing"),
        (dict(hidden_size=-1), "hidden_size=-1: must be an integer >= 1"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rotary scaling 'dynamic'"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 16}),
            "yarn beta_fast=16: jaxmoe's YaRN has 32",
        ),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0}),
            "yarn attention factor 1.0",
        ),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_models_are_refused_in_one_line(changes, message):
    with pytest.raises(ConfigError) as error:
        read(MIXTRAL_8X7B, **changes)
    assert message in str(error.value)
    assert str(error.value).startswith("config.json: ")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("values", "changes", "message"),
    [
        (QWEN2_57B, dict(mlp_only_layers=[1, 3]), "mlp_only_layers=[1, 3]: jaxmoe's dense"),
        (QWEN3_30B, dict(attention_bias=True), "attention_bias=True: Qwen3-MoE's biases"),
        (QWEN2_57B, dict(norm_topk_prob="yes"), "norm_topk_prob='yes': must be true or false"),
    ],
)
def test_family_fields_jaxmoe_cannot_follow_are_refused(values, changes, message):
    with pytest.raises(ConfigError) as error:
        read(values, **changes)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(num_key_value_heads=8), "num_key_value_heads=8: multi-head latent attention"),
        (dict(kv_lora_rank=None), "kv_lora_rank is missing"),
        (dict(qk_head_dim=128), "qk_head_dim=128: must be 192 (qk_nope_head_dim=128"),
        (dict(head_dim=128), "head_dim=128: must be 64"),
        (dict(attention_bias=True), "attention_bias=True: jaxmoe's latent attention"),
        (dict(scoring_func="softmax"), "scoring_func='softmax': jaxmoe converts DeepSeek-V3's"),
        (dict(moe_layer_freq=2), "moe_layer_freq=2: jaxmoe converts DeepSeek-V3 models"),
        (dict(first_k_dense_replace=61), "first_k_dense_replace=61: leaves no MoE layer"),
        (
            dict(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}),
            "weight_block_size=None: jaxmoe reads FP8 weights with one scale per block",
        ),
        (
            dict(quantization_config={"quant_method": "awq"}),
            "quantization_config={'quant_method': 'awq'}: jaxmoe reads block-scaled FP8",
        ),
        (
            dict(rope_scaling={**DEEPSEEK_V3["rope_scaling"], "mscale": -1}),
            "yarn mscale=-1: must be a number >= 0",
        ),
    ],
)
def test_deepseek_fields_jaxmoe_cannot_follow_are_refused(changes, message):
    with pytest.raises(ConfigError) as error:
        read(DEEPSEEK_V3, **changes)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("config.json: ")


def test_a_sliding_window_on_every_layer_maps_and_one_on_some_layers_only_is_refused():
    mixtral = config_of({**MIXTRAL_8X7B, "sliding_window": 4096}, **{"model.seq_len": 8192})
    assert mixtral.model.sliding_window == 4096
    written = hf_config(mixtral, "mixtral", "bfloat16", base=None)
    assert written["sliding_window"] == 4096
    assert config_of(written, **{"model.seq_len": 8192}).model == mixtral.model

    qwen = {**QWEN2_57B, "use_sliding_window": True, "sliding_window": 1024}
    # transformers' Qwen2 windows the layers from max_window_layers on: here none of 28.
    assert config_of(qwen).model.sliding_window is None
    every = config_of({**qwen, "max_window_layers": 0})
    assert every.model.sliding_window == 1024
    assert config_of(hf_config(every, "qwen2_moe", "bfloat16", base=None)).model == every.model
    with pytest.raises(ConfigError) as error:
        config_of({**qwen, "max_window_layers": 4})
    assert "sliding_window=1024 is shorter than model.seq_len=4096 on some layers" in str(
        error.value
    )
    assert "--model.seq_len 1024 or less" in str(error.value)


def test_fields_config_json_sets_cannot_be_overridden():
    assert config_of(MIXTRAL_8X7B, **{"model.dtype": "bfloat16"}).model.dtype == "bfloat16"
    assert config_of(MIXTRAL_8X7B, **{"moe.capacity_factor": 1.25}).moe.capacity_factor == 1.25
    assert config_of(MIXTRAL_8X7B, **{"train.learning_rate": 1e-4}).train.learning_rate == 1e-4

    with pytest.raises(ConfigError) as error:
        config_of(MIXTRAL_8X7B, **{"model.d_model": 1024})
    assert "--model.d_model: config.json sets it" in str(error.value)


def _llama(**changes) -> Config:
    model, moe = (
        ModelConfig(
            norm="rmsnorm",
            position="rope",
            activation="swiglu",
            linear_bias=False,
            tie_embeddings=False,
            moe_every=1,
            vocab_size=256,
        ),
        MoEConfig(num_experts=8, top_k=2),
    )
    sections = {"model": model, "moe": moe}
    for name, value in changes.items():
        section, field = name.split(".")
        sections[section] = dataclasses.replace(sections[section], **{field: value})
    return Config(**sections)


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("mixtral", {}, None),
        ("mixtral", {"model.norm": "layernorm"}, "model.norm='layernorm'"),
        ("mixtral", {"model.qk_norm": True}, "model.qk_norm=True"),
        ("mixtral", {"moe.normalize_top_k": False}, "moe.normalize_top_k=False"),
        ("mixtral", {"model.moe_every": 2}, "model.moe_every=2"),
        ("qwen3_moe", {}, "model.qk_norm=False"),
        ("qwen3_moe", {"model.qk_norm": True, "moe.score_function": "sigmoid"}, "moe.score"),
        ("qwen2_moe", {}, "moe.shared_expert_gate=False"),
    ],
)
def test_a_config_the_family_cannot_express_is_refused(family, changes, field):
    config = _llama(**changes)
    if field is None:
        check_expressible(config, family)
        return
    with pytest.raises(ConfigError) as error:
        check_expressible(config, family)
    assert str(error.value).startswith(f"--to-hf: {field}")
    assert f"in a {family} model" in str(error.value)
