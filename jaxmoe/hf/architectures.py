"""A Hugging Face ``config.json`` read as jaxmoe's model and MoE sections.

Read: :func:`read_architecture` checks the file's ``model_type`` (``mixtral``,
``qwen2_moe``, ``qwen3_moe``, ``deepseek_v3``, or a name another model of one of these
architectures goes by: Kimi K2's ``kimi_k2``) and every field that shapes the model, and
returns the jaxmoe fields of that model (:class:`Architecture`): RMSNorm and its
epsilon, rotary positions (theta; linear or YaRN scaling, from ``rope_scaling`` or
transformers 5's ``rope_parameters``, with DeepSeek's ``mscale`` and ``mscale_all_dim``),
grouped-query attention (key/value heads, head width), the query/key/value biases
(Qwen2-MoE), the query/key norms (Qwen3-MoE), SwiGLU without biases, the untied or tied
head, the experts (count, top-k, width, ``norm_topk_prob``), Qwen2-MoE's gated shared
expert, and the dense layers (``decoder_sparse_step`` as ``model.moe_every``,
``mlp_only_layers`` = the first k layers as ``model.first_dense_layers``). DeepSeek-V3:
multi-head latent attention (the ranks and head widths), its rotary features stored
interleaved (``rope_interleave``, :attr:`Architecture.rotary_interleaved`), the sigmoid
router with its selection bias, expert groups and ``routed_scaling_factor``, the shared
experts, ``first_k_dense_replace`` and the multi-token prediction modules
(``num_nextn_predict_layers``). A ``quantization_config`` of block-scaled FP8 weights
(:mod:`jaxmoe.hf.block_fp8`) gives :attr:`Architecture.fp8_block`. The models are
dropless: ``moe.capacity_factor`` None.
What jaxmoe cannot compute the same way is refused in one line naming the field: a
sliding window on some layers only (Qwen's ``max_window_layers``) shorter than
``model.seq_len``, a rotary scaling other than linear or
YaRN (or YaRN with other constants), an activation other than SiLU, Qwen3-MoE's
``attention_bias`` (its output projection's bias), dense layers anywhere but first.
Fields that only matter to training in transformers (``router_aux_loss_coef``,
``router_jitter_noise``, dropout) are not mapped.

The other way, a jaxmoe configuration as a ``config.json``: :mod:`jaxmoe.hf.hf_config`.
No JAX here: reading a configuration must not start it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jaxmoe.config import Config, ConfigError
from jaxmoe.hf.block_fp8 import POWER_OF_TWO, SCALE_FORMATS

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Other names of those architectures' models: model_type -> the family.
ALIASES = {"kimi_k2": "deepseek_v3"}
# transformers' defaults for fields a config.json may leave out.
DEFAULT_ROPE_THETA = {
    "mixtral": 1e6,
    "qwen2_moe": 10000.0,
    "qwen3_moe": 10000.0,
    "deepseek_v3": 10000.0,
}
# Names other model families are known by, with why they cannot be converted.
UNSUPPORTED = {
    "deepseek_v2": "its router (softmax scores, greedy group-limited choice) is not "
    "DeepSeek-V3's, and jaxmoe has only V3's",
}
# The configuration fields that give the experts' count, per family (transformers 5 saves
# Qwen3-MoE's as num_local_experts, the hub's files say num_experts).
EXPERT_COUNT = {
    "mixtral": ("num_local_experts", "num_experts"),
    "qwen2_moe": ("num_experts",),
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "deepseek_v3": ("n_routed_experts",),
}
YARN_BETA_FAST, YARN_BETA_SLOW = 32, 1


@dataclass(frozen=True)
class Architecture:
    """What a ``config.json`` says, as jaxmoe fields.

    ``model`` and ``moe``: values of ``model.*`` and ``moe.*`` fields (the rest keep the
    family preset's). ``sliding_window``: an attention window on some layers only (Qwen's
    ``max_window_layers``), which jaxmoe must check against ``model.seq_len``: it has one
    window for every layer (``model.sliding_window``). ``rotary_interleaved``: the rotated
    features of the query and key projections are stored in interleaved pairs
    (DeepSeek-V3's ``rope_interleave``), where jaxmoe rotates halves. ``fp8_block``: the
    weights are block-scaled FP8 with blocks of this shape (else None)."""

    family: str
    source: str
    values: dict[str, Any]
    model: dict[str, Any]
    moe: dict[str, Any]
    sliding_window: int | None
    dtype: str | None
    rotary_interleaved: bool = False
    fp8_block: tuple[int, int] | None = None

    def check_config(self, config: Config) -> None:
        """What depends on fields the command line may change (``model.seq_len``)."""
        window = self.sliding_window
        if window is not None and window < config.model.seq_len:
            raise ConfigError(
                f"{self.source}: sliding_window={window} is shorter than model.seq_len="
                f"{config.model.seq_len} on some layers only (max_window_layers), and jaxmoe "
                f"has one window for every layer: convert with --model.seq_len {window} or less"
            )


class _Fields:
    """The fields of one ``config.json``, read with messages naming the file and field."""

    def __init__(self, values: dict[str, Any], source: str):
        self.values = values
        self.source = source

    def error(self, name: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {name}={self.values.get(name)!r}: {problem}")

    def has(self, name: str) -> bool:
        return self.values.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.values.get(name)
        return default if value is None else value

    def first(self, names: tuple[str, ...]) -> str:
        """The first of ``names`` the file has (the first name when it has none)."""
        return next((name for name in names if self.has(name)), names[0])

    def integer(self, name: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.get(name, default)
        if value is None:
            raise ConfigError(f"{self.source}: {name} is missing: a {self._model} needs it")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(name, f"must be an integer >= {minimum}")
        return value

    def number(self, name: str, default: float | None = None) -> float:
        value = self.get(name, default)
        if value is None:
            raise ConfigError(f"{self.source}: {name} is missing: a {self._model} needs it")
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.error(name, "must be a number > 0")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, "must be true or false")
        return value

    @property
    def _model(self) -> str:
        return f"{self.values.get('model_type')} model"


def model_type_of(values: dict[str, Any], source: str) -> str:
    """The family of a ``config.json`` (its ``model_type``, or the family an alias names),
    refused unless jaxmoe converts it."""
    model_type = values.get("model_type")
    known = (*FAMILIES, *ALIASES)
    if model_type in UNSUPPORTED:
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported: {UNSUPPORTED[model_type]}; "
            f"jaxmoe converts {', '.join(known)}"
        )
    if model_type not in known:
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported: jaxmoe converts "
            f"{', '.join(known)}"
        )
    family = ALIASES.get(model_type, model_type)
    architectures = values.get("architectures")
    if architectures is not None and architectures != [ARCHITECTURES[family]]:
        raise ConfigError(
            f"{source}: architectures={architectures!r}: jaxmoe converts the causal language "
            f"model, [{ARCHITECTURES[family]!r}]"
        )
    return family


def read_architecture(values: dict[str, Any], source: str) -> Architecture:
    """The jaxmoe fields of the model a ``config.json`` (parsed: ``values``) describes.

    ``source`` names the file in messages. Raises :class:`ConfigError` in one line."""
    family = model_type_of(values, source)
    fields = _Fields(values, source)
    if fields.get("hidden_act", "silu") != "silu":
        raise fields.error("hidden_act", "jaxmoe's SwiGLU (model.activation swiglu) uses silu")
    heads = fields.integer("num_attention_heads")
    hidden = fields.integer("hidden_size")
    layers = fields.integer("num_hidden_layers")
    model: dict[str, Any] = dict(
        vocab_size=fields.integer("vocab_size"),
        d_model=hidden,
        num_heads=heads,
        num_layers=layers,
        num_kv_heads=fields.integer("num_key_value_heads", heads),
        head_dim=None,
        norm="rmsnorm",
        norm_eps=fields.number("rms_norm_eps", 1e-5 if family == "mixtral" else 1e-6),
        position="rope",
        activation="swiglu",
        linear_bias=False,
        tie_embeddings=fields.boolean("tie_word_embeddings", False),
        attention_bias=False,
        qk_norm=False,
        seq_len=min(fields.integer("max_position_embeddings", 4096), 4096),
        dtype="float32",
        moe_every=1,
        first_dense_layers=0,
    )
    if family == "deepseek_v3":  # its head_dim is the rotary width (qk_rope_head_dim)
        pass
    elif fields.has("head_dim"):
        model["head_dim"] = fields.integer("head_dim")
    elif hidden % heads:
        raise fields.error(
            "num_attention_heads", f"does not divide hidden_size={hidden}, and head_dim is unset"
        )
    model.update(_rope_fields(fields, family))
    experts_field = fields.first(EXPERT_COUNT[family])
    moe: dict[str, Any] = dict(
        num_experts=fields.integer(experts_field),
        top_k=fields.integer("num_experts_per_tok"),
        capacity_factor=None,
        score_function="softmax",
        routed_scaling_factor=1.0,
        num_expert_groups=1,
        top_k_expert_groups=None,
        expert_bias_rate=0.0,
        normalize_top_k=True,
        d_expert=None,
        num_shared_experts=0,
        d_shared_expert=None,
        shared_expert_gate=False,
    )
    window = None
    if family == "deepseek_v3":
        model.update(_latent_attention(fields, heads))
        model.update(_deepseek_layers(fields, layers))
        moe.update(_deepseek_router(fields))
        # Its selection bias is a tensor of the model; the rate it moves at, the preset's.
        del moe["expert_bias_rate"]
    elif family == "mixtral":
        model["d_ff"] = fields.integer("intermediate_size")
        if fields.get("sliding_window") is not None:  # Mistral's window, on every layer
            model["sliding_window"] = fields.integer("sliding_window")
    else:
        moe["normalize_top_k"] = fields.boolean("norm_topk_prob", False)
        moe["d_expert"] = fields.integer("moe_intermediate_size")
        model.update(_dense_layers(fields, layers))
        dense = model["first_dense_layers"] > 0 or model["moe_every"] > 1
        # The dense layers' width; with none, the experts' (as the presets have it), so
        # that an unused intermediate_size cannot refuse a layout.
        model["d_ff"] = fields.integer("intermediate_size") if dense else moe["d_expert"]
        if fields.boolean("use_sliding_window", False) and fields.get("sliding_window"):
            # Windowed are the layers from max_window_layers on (transformers' Qwen2).
            first = fields.integer("max_window_layers", layers, minimum=0)
            if first == 0:
                model["sliding_window"] = fields.integer("sliding_window")
            elif first < layers:
                window = fields.integer("sliding_window")
    if family == "qwen2_moe":
        model["attention_bias"] = fields.boolean("qkv_bias", True)
        moe.update(
            num_shared_experts=1,
            d_shared_expert=fields.integer("shared_expert_intermediate_size"),
            shared_expert_gate=True,
        )
    if family == "qwen3_moe":
        model["qk_norm"] = True
        if fields.boolean("attention_bias", False):
            raise fields.error(
                "attention_bias",
                "Qwen3-MoE's biases include the output projection's, which jaxmoe has only "
                "with model.linear_bias (on every layer): not supported",
            )
    dtype = values.get("dtype", values.get("torch_dtype"))
    interleaved = rotary_interleaved(values, family)
    if interleaved:
        fields.boolean("rope_interleave", True)  # a boolean when given
    return Architecture(
        family, source, values, model, moe, window, dtype, interleaved, _fp8_block(fields)
    )


def rotary_interleaved(values: dict[str, Any] | None, family: str) -> bool:
    """Whether a ``family`` model with this ``config.json`` (None: a new one) stores its
    rotated query and key features in interleaved pairs (DeepSeek-V3's
    ``rope_interleave``, true unless the file says otherwise)."""
    return family == "deepseek_v3" and (values or {}).get("rope_interleave", True) is not False


def _latent_attention(fields: _Fields, heads: int) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: its ranks and head widths (a query
    rank of null: queries straight from the residual stream)."""
    kv_heads = fields.get("num_key_value_heads", heads)
    if kv_heads != heads:
        raise fields.error(
            "num_key_value_heads",
            f"multi-head latent attention gives every head its key and value: must be "
            f"num_attention_heads={heads}",
        )
    if fields.boolean("attention_bias", False):
        raise fields.error("attention_bias", "jaxmoe's latent attention has no biases")
    nope, rope = fields.integer("qk_nope_head_dim"), fields.integer("qk_rope_head_dim")
    # transformers' derived widths, where the file has them, must agree with the ranks.
    for name, width in (("qk_head_dim", nope + rope), ("head_dim", rope)):
        if fields.has(name) and fields.get(name) != width:
            raise fields.error(
                name,
                f"must be {width} (qk_nope_head_dim={nope}, qk_rope_head_dim={rope}): the "
                "latent attention's widths disagree",
            )
    return dict(
        num_kv_heads=None,
        kv_lora_rank=fields.integer("kv_lora_rank"),
        q_lora_rank=fields.integer("q_lora_rank") if fields.has("q_lora_rank") else None,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=fields.integer("v_head_dim"),
    )


def _deepseek_layers(fields: _Fields, layers: int) -> dict[str, Any]:
    """The dense layers (``first_k_dense_replace``), their width, and the multi-token
    prediction modules stored after the last layer (``num_nextn_predict_layers``)."""
    if fields.get("moe_layer_freq", 1) != 1:
        raise fields.error(
            "moe_layer_freq",
            "jaxmoe converts DeepSeek-V3 models whose layers after the dense ones are all MoE",
        )
    first = fields.integer("first_k_dense_replace", 0, minimum=0)
    if first >= layers:
        raise fields.error("first_k_dense_replace", f"leaves no MoE layer among {layers}")
    return dict(
        d_ff=fields.integer("intermediate_size"),
        first_dense_layers=first,
        moe_every=1,
        mtp_depth=fields.integer("num_nextn_predict_layers", 0, minimum=0),
    )


def _deepseek_router(fields: _Fields) -> dict[str, Any]:
    """DeepSeek-V3's router: sigmoid scores, a selection bias, expert groups, the scaled
    weights; its experts' width and shared experts."""
    for name, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if fields.get(name, value) != value:
            raise fields.error(name, f"jaxmoe converts DeepSeek-V3's router ({name} {value!r})")
    groups = fields.integer("n_group", 1)
    return dict(
        score_function="sigmoid",
        routed_scaling_factor=fields.number("routed_scaling_factor", 1.0),
        num_expert_groups=groups,
        top_k_expert_groups=fields.integer("topk_group", groups),
        normalize_top_k=fields.boolean("norm_topk_prob", True),
        d_expert=fields.integer("moe_intermediate_size"),
        num_shared_experts=fields.integer("n_shared_experts", 0, minimum=0),
    )


def _fp8_block(fields: _Fields) -> tuple[int, int] | None:
    """The block of block-scaled FP8 weights (``quantization_config``), or None."""
    name = "quantization_config"
    settings = fields.get(name)
    if settings is None:
        return None
    if not isinstance(settings, dict) or settings.get("quant_method") != "fp8":
        raise fields.error(
            name, "jaxmoe reads block-scaled FP8 weights (quant_method 'fp8') or unquantized ones"
        )
    if settings.get("fmt", "e4m3") != "e4m3":
        raise fields.error(name, f"fmt={settings.get('fmt')!r}: jaxmoe reads e4m3 weights")
    if settings.get("scale_fmt") not in SCALE_FORMATS:
        raise fields.error(
            name,
            f"scale_fmt={settings.get('scale_fmt')!r}: jaxmoe reads float32 scales, powers of "
            f"two ({POWER_OF_TWO!r}) or not",
        )
    block = settings.get("weight_block_size")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)
    ):
        raise fields.error(
            name,
            f"weight_block_size={block!r}: jaxmoe reads FP8 weights with one scale per block "
            "of [rows, columns] elements, such as [128, 128]",
        )
    return block[0], block[1]


def _dense_layers(fields: _Fields, layers: int) -> dict[str, int]:
    """``decoder_sparse_step`` and ``mlp_only_layers`` as ``model.moe_every`` and
    ``model.first_dense_layers``: jaxmoe's dense layers are the first k, then every layer
    whose index + 1 is not a multiple of moe_every (transformers' rule for the step)."""
    step = fields.integer("decoder_sparse_step", 1)
    only = fields.get("mlp_only_layers", [])
    if not isinstance(only, list) or only != list(range(len(only))):
        raise fields.error(
            "mlp_only_layers",
            "jaxmoe's dense layers must be the first ones (model.first_dense_layers): "
            "only [0, 1, ..., k - 1] can be converted",
        )
    if len(only) >= layers:
        raise fields.error("mlp_only_layers", f"leaves no MoE layer among {layers} layers")
    return {"moe_every": step, "first_dense_layers": len(only)}


def _rope_parameters(fields: _Fields, family: str) -> tuple[float, dict[str, Any], str]:
    """The rotary parameters, from transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` and ``rope_scaling``: (theta, the scaling dict, its field's name)."""
    parameters = fields.get("rope_parameters")
    if parameters is not None:
        name = "rope_parameters"
        if not isinstance(parameters, dict) or any(
            isinstance(value, dict) for value in parameters.values()
        ):
            raise fields.error(name, "jaxmoe reads one set of rotary parameters for every layer")
        theta = parameters.get("rope_theta", fields.get("rope_theta"))
    else:
        name = "rope_scaling"
        parameters = fields.get(name, {})
        if not isinstance(parameters, dict):
            raise fields.error(name, "must be an object or null")
        theta = fields.get("rope_theta")
    theta = DEFAULT_ROPE_THETA[family] if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise fields.error(name, f"rope_theta={theta!r} must be a number > 0")
    return float(theta), parameters, name


def _rope_fields(fields: _Fields, family: str) -> dict[str, Any]:
    """``model.rope_theta``, ``model.rope_scaling``, its factor and original context."""
    theta, parameters, name = _rope_parameters(fields, family)
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    values: dict[str, Any] = dict(
        rope_theta=theta,
        rope_scaling="none",
        rope_scaling_factor=1.0,
        rope_mscale=0.0,
        rope_mscale_all_dim=0.0,
    )
    partial = parameters.get("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise fields.error(name, f"partial_rotary_factor={partial!r}: jaxmoe rotates whole heads")
    if kind == "default":
        return values
    if kind not in ("linear", "yarn"):
        raise fields.error(
            name,
            f"rotary scaling {kind!r} is not supported: jaxmoe has linear and yarn "
            "(model.rope_scaling)",
        )
    factor = parameters.get("factor")
    original = parameters.get(
        "original_max_position_embeddings",
        fields.get("original_max_position_embeddings", fields.get("max_position_embeddings")),
    )
    if factor is None and kind == "yarn" and original:
        factor = fields.integer("max_position_embeddings") / original
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
        raise fields.error(name, f"factor={factor!r}: must be a number >= 1")
    values.update(rope_scaling=kind, rope_scaling_factor=float(factor))
    if kind == "linear":
        return values
    if isinstance(original, float) and original.is_integer():
        original = int(original)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise fields.error(name, f"original_max_position_embeddings={original!r}: must be >= 1")
    values["rope_original_seq_len"] = original
    expected = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    constants = {
        "beta_fast": (parameters.get("beta_fast"), (None, YARN_BETA_FAST)),
        "beta_slow": (parameters.get("beta_slow"), (None, YARN_BETA_SLOW)),
        "truncate": (parameters.get("truncate"), (None, True)),
    }
    for key, (value, allowed) in constants.items():
        if value not in allowed:
            raise fields.error(name, f"yarn {key}={value!r}: jaxmoe's YaRN has {allowed[1]}")
    attention = parameters.get("attention_factor")
    mscale, mscale_all = parameters.get("mscale"), parameters.get("mscale_all_dim")
    for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value < 0
        ):
            raise fields.error(name, f"yarn {key}={value!r}: must be a number >= 0")
    if mscale and mscale_all:  # DeepSeek's: jaxmoe scales as transformers does
        values.update(rope_mscale=float(mscale), rope_mscale_all_dim=float(mscale_all))
        scaled = lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        expected = scaled(mscale) / scaled(mscale_all)
    elif mscale_all and family == "deepseek_v3":  # the softmax scale's alone
        values["rope_mscale_all_dim"] = float(mscale_all)
    if attention is not None and not math.isclose(attention, expected, rel_tol=1e-9):
        raise fields.error(
            name,
            f"yarn attention factor {attention!r}: jaxmoe's YaRN scales by 0.1 ln(factor) + 1 "
            f"= {expected!r}",
        )
    return values


def rotary_fields(values: dict[str, Any], family: str) -> dict[str, Any]:
    """The ``model.rope_*`` fields ``values`` (a ``config.json``) states for ``family``."""
    return _rope_fields(_Fields(values, "config.json"), family)
