"""A jaxmoe configuration as a Hugging Face ``config.json`` (the other way of
:mod:`jaxmoe.hf.architectures`).

:func:`hf_config` gives the ``config.json`` of a jaxmoe configuration, on top of
the one it was converted from when there is one (token ids, ``max_position_embeddings``
and the other fields jaxmoe has no use for are kept), refusing a configuration that the
family cannot express. No JAX here.
"""

from __future__ import annotations

from typing import Any

from jaxmoe.config import Config, ConfigError, ModelConfig
from jaxmoe.config.moe import shared_width
from jaxmoe.hf.architectures import (
    ALIASES,
    ARCHITECTURES,
    EXPERT_COUNT,
    FAMILIES,
    model_type_of,
    rotary_fields,
)


def inexpressible(config: Config, family: str) -> tuple[str, Any, Any] | None:
    """The first field of ``config`` that ``family``'s transformers model cannot express:
    ``(field, its value, the value the family has)``; None if it can express them all."""
    model, moe = config.model, config.moe
    required = {
        "model.norm": (model.norm, "rmsnorm"),
        "model.position": (model.position, "rope"),
        "model.activation": (model.activation, "swiglu"),
        "model.linear_bias": (model.linear_bias, False),
        "model.qk_norm": (model.qk_norm, family == "qwen3_moe"),
    }
    if family == "deepseek_v3":
        required.update(
            {
                "model.kv_lora_rank": (model.kv_lora_rank, model.kv_lora_rank or "a rank"),
                "model.attention_bias": (model.attention_bias, False),
                "model.moe_every": (model.moe_every, 1),
                "moe.score_function": (moe.score_function, "sigmoid"),
                # The selection bias (e_score_correction_bias) is a tensor of every model.
                "moe.expert_bias_rate": (
                    moe.expert_bias_rate,
                    moe.expert_bias_rate if moe.expert_bias_rate > 0 else "a rate > 0",
                ),
                "moe.shared_expert_gate": (moe.shared_expert_gate, False),
                "moe.d_shared_expert": (
                    shared_width(model, moe),
                    moe.num_shared_experts * (moe.d_expert or model.d_ff),
                ),
            }
        )
    else:
        required.update(
            {
                "moe.score_function": (moe.score_function, "softmax"),
                "moe.routed_scaling_factor": (moe.routed_scaling_factor, 1.0),
                "moe.num_expert_groups": (moe.num_expert_groups, 1),
                "moe.expert_bias_rate": (moe.expert_bias_rate, 0.0),
                "model.kv_lora_rank": (model.kv_lora_rank, None),
                "model.mtp_depth": (model.mtp_depth, 0),
            }
        )
    if family == "mixtral":
        required.update(
            {
                "model.attention_bias": (model.attention_bias, False),
                "moe.num_shared_experts": (moe.num_shared_experts, 0),
                "model.moe_every": (model.moe_every, 1),
                "model.first_dense_layers": (model.first_dense_layers, 0),
                "moe.normalize_top_k": (moe.normalize_top_k, True),
                "moe.d_expert": (moe.d_expert or model.d_ff, model.d_ff),
            }
        )
    if family == "qwen2_moe":
        required["moe.shared_expert_gate"] = (moe.shared_expert_gate, True)
    if family == "qwen3_moe":
        required["model.attention_bias"] = (model.attention_bias, False)
        required["moe.num_shared_experts"] = (moe.num_shared_experts, 0)
    for field, (value, needed) in required.items():
        if value != needed:
            return field, value, needed
    return None


def check_expressible(config: Config, family: str) -> None:
    """Refuse, in one line naming the field, a configuration that ``family``'s
    transformers model cannot express."""
    found = inexpressible(config, family)
    if found is not None:
        field, value, needed = found
        raise ConfigError(f"--to-hf: {field}={value!r}: must be {needed!r} in a {family} model")


def _put(values: dict[str, Any], names: tuple[str, ...], value: Any) -> None:
    """Set every one of ``names`` the file has (the first name when it has none)."""
    present = [name for name in names if name in values]
    for name in present or names[:1]:
        values[name] = value


def _rope_entries(model: ModelConfig, base: dict[str, Any], family: str) -> dict[str, Any]:
    """The rotary fields of ``config.json``, in the format of ``base`` (transformers 5's
    ``rope_parameters``, else ``rope_theta`` and ``rope_scaling``); ``base``'s entries
    unchanged when they already say what ``model`` does."""
    try:
        if base and rotary_fields(base, family) == _rope_fields_of(model):
            return {
                key: base[key]
                for key in ("rope_parameters", "rope_theta", "rope_scaling")
                if key in base
            }
    except ConfigError:
        pass
    scaling: dict[str, Any] = {}
    if model.rope_scaling != "none":
        scaling = {"rope_type": model.rope_scaling, "factor": model.rope_scaling_factor}
        if model.rope_scaling == "yarn":
            scaling["original_max_position_embeddings"] = model.rope_original_seq_len
            if model.rope_mscale:
                scaling["mscale"] = model.rope_mscale
            if model.rope_mscale_all_dim:
                scaling["mscale_all_dim"] = model.rope_mscale_all_dim
    if "rope_parameters" in base:
        return {
            "rope_parameters": {"rope_theta": model.rope_theta, "rope_type": "default", **scaling}
        }
    return {"rope_theta": model.rope_theta, "rope_scaling": scaling or None}


def _rope_fields_of(model: ModelConfig) -> dict[str, Any]:
    values: dict[str, Any] = dict(
        rope_theta=model.rope_theta,
        rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor if model.rope_scaling != "none" else 1.0,
        rope_mscale=0.0,
        rope_mscale_all_dim=0.0,
    )
    if model.rope_scaling == "yarn":
        values.update(
            rope_original_seq_len=model.rope_original_seq_len,
            rope_mscale=model.rope_mscale,
            rope_mscale_all_dim=model.rope_mscale_all_dim,
        )
    return values


def hf_config(
    config: Config,
    family: str,
    dtype: str,
    base: dict[str, Any] | None,
    fp8_block: tuple[int, int] | None = None,
) -> dict:
    """The ``config.json`` of ``config`` as a ``family`` model whose weights are stored in
    ``dtype`` (its linear layers' as block-scaled FP8 with blocks of ``fp8_block``, when
    given), on top of ``base`` (the file it was converted from, or None)."""
    check_expressible(config, family)
    model, moe = config.model, config.moe
    values = dict(base or {})
    model_type = values.get("model_type")
    values.update(
        architectures=[ARCHITECTURES[family]],
        model_type=model_type if ALIASES.get(model_type) == family else family,
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        num_attention_heads=model.num_heads,
        num_hidden_layers=model.num_layers,
        num_key_value_heads=model.kv_heads,
        hidden_act="silu",
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        num_experts_per_tok=moe.top_k,
    )
    context = model.seq_len
    if model.rope_scaling == "yarn":
        context = max(context, int(model.rope_original_seq_len * model.rope_scaling_factor))
    values.setdefault("max_position_embeddings", context)
    if family == "deepseek_v3":
        pass  # _deepseek_entries
    elif model.head_dim is not None or family == "qwen3_moe" or values.get("head_dim") is not None:
        values["head_dim"] = model.attention_head_dim
    for key in ("rope_parameters", "rope_theta", "rope_scaling"):
        values.pop(key, None)
    values.update(_rope_entries(model, base or {}, family))
    _put(values, EXPERT_COUNT[family], moe.num_experts)
    if family == "deepseek_v3":
        values.update(_deepseek_entries(config, base))
    elif family == "mixtral":
        values["intermediate_size"] = model.d_ff
        values["sliding_window"] = model.sliding_window
    else:
        dense = model.first_dense_layers > 0 or model.moe_every > 1
        if dense or "intermediate_size" not in values:
            values["intermediate_size"] = model.d_ff
        values.update(
            moe_intermediate_size=moe.d_expert or model.d_ff,
            norm_topk_prob=moe.normalize_top_k,
            decoder_sparse_step=model.moe_every,
        )
        if model.first_dense_layers or "mlp_only_layers" in values:
            values["mlp_only_layers"] = list(range(model.first_dense_layers))
        window = values.get("sliding_window")
        if model.sliding_window is not None:  # on every layer
            values.update(
                use_sliding_window=True, sliding_window=model.sliding_window, max_window_layers=0
            )
        elif values.get("use_sliding_window") and window and window < model.seq_len:
            values["use_sliding_window"] = False
    if family == "qwen2_moe":
        values["shared_expert_intermediate_size"] = shared_width(model, moe)
        if "qkv_bias" in values or not model.attention_bias:
            values["qkv_bias"] = model.attention_bias
        if "layer_types" in values and not values.get("use_sliding_window"):
            values["layer_types"] = ["full_attention"] * model.num_layers
    if family == "qwen3_moe":
        values["attention_bias"] = False
    _put(values, ("dtype", "torch_dtype"), dtype)
    values.pop("quantization_config", None)
    if fp8_block is not None:
        settings = dict((base or {}).get("quantization_config") or {})
        if settings.get("quant_method") != "fp8":
            settings = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
        values["quantization_config"] = {**settings, "weight_block_size": list(fp8_block)}
    return dict(sorted(values.items()))


def _deepseek_entries(config: Config, base: dict[str, Any] | None) -> dict[str, Any]:
    """DeepSeek-V3's fields: latent attention, router, experts, dense and MTP layers (on
    top of ``base``, the file converted from, or None)."""
    model, moe = config.model, config.moe
    entries: dict[str, Any] = dict(
        num_key_value_heads=model.num_heads,
        kv_lora_rank=model.kv_lora_rank,
        q_lora_rank=model.q_lora_rank,
        qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        attention_bias=False,
        intermediate_size=model.d_ff,
        moe_intermediate_size=moe.d_expert or model.d_ff,
        n_shared_experts=moe.num_shared_experts,
        first_k_dense_replace=model.first_dense_layers,
        n_group=moe.num_expert_groups,
        topk_group=moe.top_k_expert_groups or moe.num_expert_groups,
        routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=moe.normalize_top_k,
    )
    # transformers writes these beside the widths: the rotary width as head_dim, the
    # query's as qk_head_dim, and rope_interleave (true unless the file says otherwise).
    new, values = base is None, base or {}
    if new or "head_dim" in values:
        entries["head_dim"] = model.rotary_head_dim
    if new or "qk_head_dim" in values:
        entries["qk_head_dim"] = model.attention_head_dim
    if new:
        entries["rope_interleave"] = True
    if model.mtp_depth or "num_nextn_predict_layers" in values:
        entries["num_nextn_predict_layers"] = model.mtp_depth
    for name, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if name in values:
            entries[name] = value
    return entries


def architecture_of(config: Config, base: dict[str, Any] | None, family: str | None) -> str:
    """The family to write ``config`` as: ``family`` when given, else the one its
    ``config.json`` was converted from."""
    if family is not None:
        return family
    if base is None:
        raise ConfigError(
            "--to-hf: the run was not converted from a Hugging Face model, so its "
            f"architecture is unknown: name it with --model-type ({', '.join(FAMILIES)})"
        )
    return model_type_of(base, "the run's hf/config.json")
