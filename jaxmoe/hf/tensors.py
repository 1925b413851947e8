"""Which Hugging Face tensor is which part of which jaxmoe parameter: one table.

The jaxmoe parameter tree decides what a checkpoint must hold: :func:`tensor_rules`
walks the model's leaves (built from its configuration, nothing allocated) and looks
each up in :data:`BLOCK_TENSORS` or :data:`MODEL_TENSORS`, which name the transformers
tensors that fill it and where each goes. A leaf the table does not know is refused in
one line (the table needs a row: a new kind of parameter, such as a router's expert
bias, is one more row, with ``collection="model_state"`` for a variable that is not a
parameter). Names in the templates: ``{moe}``, ``{gate}``, ``{up}``, ``{down}`` differ
by family (:data:`FAMILY_NAMES`); ``{e}`` is an expert, and a row with it is repeated
for every expert along the leaf's leading axis. DeepSeek-V3's layers differ from the
others' in their attention (multi-head latent attention), their shared experts and their
router's selection bias: :data:`FAMILY_BLOCK_TENSORS` has those rows. Its multi-token
prediction modules are stored as layers after the last one (``mtp.{k}`` is layer
``num_hidden_layers + k``): their block as any layer's, their norms and projection by
:data:`MTP_TENSORS`, and the copies they keep of the model's embedding and head
(:data:`MTP_COPIES`), which jaxmoe shares: written from the model's, not read.

Layouts: a torch ``Linear`` weight is ``[out, in]`` and jaxmoe's kernels are
``[in, *out]``, so a ``LINEAR`` tensor is transposed and its output axis unflattened
(``q_proj.weight [heads * head_dim, d]`` -> ``query.kernel [d, heads, head_dim]``); a
``VECTOR`` (a bias, a norm's scale) is reshaped; a ``SAME`` tensor (the token
embedding) is copied. Key and value projections fill ``key_value.kernel [d, 2, kv_heads,
head_dim]`` at index 0 and 1 of its second axis; gate and up matrices fill
``gate_up.kernel [d, 2, h]`` and ``experts.w_in [E, d, 2, h]`` the same way (gate 0, up
1). DeepSeek-V3 stores the rotated features of its query and key projections in
interleaved pairs (``rope_interleave``) where jaxmoe rotates halves
(:mod:`jaxmoe.layers.rotary`): a ``rotary`` part's last ``qk_rope_head_dim`` output
features are permuted from one order to the other. Every conversion is a transpose, a
reshape and a permutation of the same numbers, exact both ways.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxmoe.config import ConfigError

LINEAR, VECTOR, SAME = "linear", "vector", "same"
ALL = slice(None)

# The family's names for the MoE block and the experts' three matrices, and the
# config.json fields that give the experts' count and width (for messages).
_PROJECTIONS = dict(
    moe="mlp", gate="gate_proj", up="up_proj", down="down_proj",
    expert_width="moe_intermediate_size",
)  # fmt: skip
FAMILY_NAMES = {
    "mixtral": dict(
        moe="block_sparse_moe",
        gate="w1",
        up="w3",
        down="w2",
        experts="num_local_experts",
        expert_width="intermediate_size",
    ),
    "qwen2_moe": dict(_PROJECTIONS, experts="num_experts"),
    "qwen3_moe": dict(_PROJECTIONS, experts="num_experts"),
    "deepseek_v3": dict(_PROJECTIONS, experts="n_routed_experts"),
}


@dataclass(frozen=True)
class Part:
    """One transformers tensor of a jaxmoe leaf: its name (a template), where it goes in
    the leaf (``index``), its layout, and the config.json fields of its dimensions."""

    name: str
    index: tuple[Any, ...] = ()
    layout: str = LINEAR
    dims: tuple[str, ...] = ()
    rotary: bool = False  # its last qk_rope_head_dim output features are rotated


_Q = "num_attention_heads x head_dim"
_KV = "num_key_value_heads x head_dim"
_D = "hidden_size"

# jaxmoe leaf under ``blocks.{layer}`` -> the tensors under ``model.layers.{layer}``.
BLOCK_TENSORS: dict[str, tuple[Part, ...]] = {
    "attention_norm.scale": (Part("input_layernorm.weight", (), VECTOR, (_D,)),),
    "attention.query.kernel": (Part("self_attn.q_proj.weight", (), LINEAR, (_Q, _D)),),
    "attention.query.bias": (Part("self_attn.q_proj.bias", (), VECTOR, (_Q,)),),
    "attention.key_value.kernel": (
        Part("self_attn.k_proj.weight", (ALL, 0), LINEAR, (_KV, _D)),
        Part("self_attn.v_proj.weight", (ALL, 1), LINEAR, (_KV, _D)),
    ),
    "attention.key_value.bias": (
        Part("self_attn.k_proj.bias", (0,), VECTOR, (_KV,)),
        Part("self_attn.v_proj.bias", (1,), VECTOR, (_KV,)),
    ),
    "attention.query_norm.scale": (Part("self_attn.q_norm.weight", (), VECTOR, ("head_dim",)),),
    "attention.key_norm.scale": (Part("self_attn.k_norm.weight", (), VECTOR, ("head_dim",)),),
    "attention.out.kernel": (Part("self_attn.o_proj.weight", (), LINEAR, (_D, _Q)),),
    "ffn_norm.scale": (Part("post_attention_layernorm.weight", (), VECTOR, (_D,)),),
    # A dense layer's FFN.
    "ffn.gate_up.kernel": (
        Part("mlp.gate_proj.weight", (ALL, 0), LINEAR, ("intermediate_size", _D)),
        Part("mlp.up_proj.weight", (ALL, 1), LINEAR, ("intermediate_size", _D)),
    ),
    "ffn.down.kernel": (Part("mlp.down_proj.weight", (), LINEAR, (_D, "intermediate_size")),),
    # An MoE layer.
    "ffn.router.kernel": (Part("{moe}.gate.weight", (), LINEAR, ("{experts}", _D)),),
    "ffn.experts.w_in": (
        Part("{moe}.experts.{e}.{gate}.weight", ("{e}", ALL, 0), LINEAR, ("{expert_width}", _D)),
        Part("{moe}.experts.{e}.{up}.weight", ("{e}", ALL, 1), LINEAR, ("{expert_width}", _D)),
    ),
    "ffn.experts.w_out": (
        Part("{moe}.experts.{e}.{down}.weight", ("{e}",), LINEAR, (_D, "{expert_width}")),
    ),
    # Qwen2-MoE's shared expert and its gate.
    "shared.ffn.gate_up.kernel": (
        Part(
            "mlp.shared_expert.gate_proj.weight",
            (ALL, 0),
            LINEAR,
            ("shared_expert_intermediate_size", _D),
        ),
        Part(
            "mlp.shared_expert.up_proj.weight",
            (ALL, 1),
            LINEAR,
            ("shared_expert_intermediate_size", _D),
        ),
    ),
    "shared.ffn.down.kernel": (
        Part(
            "mlp.shared_expert.down_proj.weight",
            (),
            LINEAR,
            (_D, "shared_expert_intermediate_size"),
        ),
    ),
    "shared.gate.kernel": (Part("mlp.shared_expert_gate.weight", (), LINEAR, ("1", _D)),),
}

# DeepSeek-V3's rows in place of the others' (or beside them).
_ROPE = "qk_rope_head_dim"
_QK = f"num_attention_heads x (qk_nope_head_dim + {_ROPE})"
_SHARED = "n_shared_experts x moe_intermediate_size"
FAMILY_BLOCK_TENSORS: dict[str, dict[str, tuple[Part, ...]]] = {
    "deepseek_v3": {
        "attention.query.kernel": (
            Part("self_attn.q_proj.weight", (), LINEAR, (_QK, _D), rotary=True),
        ),
        "attention.query_down.kernel": (
            Part("self_attn.q_a_proj.weight", (), LINEAR, ("q_lora_rank", _D)),
        ),
        "attention.query_norm.scale": (
            Part("self_attn.q_a_layernorm.weight", (), VECTOR, ("q_lora_rank",)),
        ),
        "attention.query_up.kernel": (
            Part("self_attn.q_b_proj.weight", (), LINEAR, (_QK, "q_lora_rank"), rotary=True),
        ),
        "attention.kv_down.kernel": (
            Part(
                "self_attn.kv_a_proj_with_mqa.weight",
                (),
                LINEAR,
                (f"kv_lora_rank + {_ROPE}", _D),
                rotary=True,
            ),
        ),
        "attention.kv_norm.scale": (
            Part("self_attn.kv_a_layernorm.weight", (), VECTOR, ("kv_lora_rank",)),
        ),
        "attention.kv_up.kernel": (
            Part(
                "self_attn.kv_b_proj.weight",
                (),
                LINEAR,
                ("num_attention_heads x (qk_nope_head_dim + v_head_dim)", "kv_lora_rank"),
            ),
        ),
        "attention.out.kernel": (
            Part("self_attn.o_proj.weight", (), LINEAR, (_D, "num_attention_heads x v_head_dim")),
        ),
        "ffn.router.expert_bias": (
            Part("mlp.gate.e_score_correction_bias", (), VECTOR, ("n_routed_experts",)),
        ),
        "shared.ffn.gate_up.kernel": (
            Part("mlp.shared_experts.gate_proj.weight", (ALL, 0), LINEAR, (_SHARED, _D)),
            Part("mlp.shared_experts.up_proj.weight", (ALL, 1), LINEAR, (_SHARED, _D)),
        ),
        "shared.ffn.down.kernel": (
            Part("mlp.shared_experts.down_proj.weight", (), LINEAR, (_D, _SHARED)),
        ),
    },
}

# A multi-token prediction module's leaves outside its block (jaxmoe ``mtp.{k}.*``) ->
# the tensors of its layer, ``model.layers.{num_hidden_layers + k}``.
MTP_TENSORS: dict[str, tuple[Part, ...]] = {
    "embedding_norm.scale": (Part("enorm.weight", (), VECTOR, (_D,)),),
    "hidden_norm.scale": (Part("hnorm.weight", (), VECTOR, (_D,)),),
    "projection.kernel": (Part("eh_proj.weight", (), LINEAR, (_D, "2 x hidden_size")),),
    "final_norm.scale": (Part("shared_head.norm.weight", (), VECTOR, (_D,)),),
}
# The copies an MTP layer stores of the model's embedding and head: its tensor -> the
# model's leaf (the embedding when the head is tied to it).
MTP_COPIES = {
    "embed_tokens.weight": ("token_embed.embedding",),
    "shared_head.head.weight": ("head.kernel", "token_embed.embedding"),
}

# jaxmoe leaves outside the blocks -> their tensors.
MODEL_TENSORS: dict[str, tuple[Part, ...]] = {
    "token_embed.embedding": (Part("model.embed_tokens.weight", (), SAME, ("vocab_size", _D)),),
    "final_norm.scale": (Part("model.norm.weight", (), VECTOR, (_D,)),),
    "head.kernel": (Part("lm_head.weight", (), LINEAR, ("vocab_size", _D)),),
}

# Tensors some checkpoints hold that are not weights (rotary tables saved by old versions).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorRule:
    """One transformers tensor: the jaxmoe leaf it is part of and how it converts."""

    name: str
    collection: str  # "params", or "model_state" for variables that are not parameters
    path: tuple[str | int, ...]  # the leaf's keys in its collection's pure dict
    index: tuple[Any, ...]  # where the part lies in the leaf
    part_shape: tuple[int, ...]  # the part's shape in jaxmoe's layout
    layout: str
    dims: tuple[str, ...]  # the config.json fields of the tensor's dimensions
    interleaved: int = 0  # the trailing output features stored in interleaved pairs
    copy: bool = False  # a copy of the leaf (an MTP layer's embedding or head): not read

    @property
    def block_fp8(self) -> bool:
        """Whether an FP8 checkpoint stores it in block-scaled FP8: the linear layers of
        the decoder (and MTP) layers, but the routers and Qwen2-MoE's shared-expert gate,
        which DeepSeek-V3's and transformers' FP8 checkpoints keep in higher precision."""
        return (
            self.layout == LINEAR
            and not self.copy
            and self.name.startswith("model.layers.")
            and "router" not in self.path
            and self.path[-2:] != ("gate", "kernel")
        )

    @property
    def kept_float32(self) -> bool:
        """Whether checkpoints keep it in float32 whatever the others' dtype: the routers'
        selection bias (DeepSeek-V3's and transformers' ``e_score_correction_bias``),
        whose small updates a narrower type would lose."""
        return "expert_bias" in self.path

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The tensor's shape in transformers' layout."""
        if self.layout == LINEAR:
            return (math.prod(self.part_shape[1:]), self.part_shape[0])
        if self.layout == VECTOR:
            return (math.prod(self.part_shape),)
        return self.part_shape

    def to_jaxmoe(self, tensor: np.ndarray) -> np.ndarray:
        """The transformers tensor as its part of the jaxmoe leaf."""
        if self.layout == LINEAR:
            tensor = tensor.T
        part = tensor.reshape(self.part_shape)
        if self.interleaved:
            part = _permute_rotary(part, self.interleaved, _halves_order(self.interleaved))
        return part

    def to_hf(self, part: np.ndarray) -> np.ndarray:
        """The jaxmoe part as the transformers tensor (C-contiguous)."""
        if self.interleaved:
            order = np.argsort(_halves_order(self.interleaved))
            part = _permute_rotary(part, self.interleaved, order)
        if self.layout == LINEAR:
            return np.ascontiguousarray(part.reshape(self.part_shape[0], -1).T)
        return np.ascontiguousarray(part.reshape(self.hf_shape))


def _halves_order(width: int) -> np.ndarray:
    """The interleaved features ``[x0, y0, x1, y1, ...]`` in rotate-half order ``[x0, x1,
    ..., y0, y1, ...]`` (indices into the interleaved ones)."""
    return np.concatenate([np.arange(0, width, 2), np.arange(1, width, 2)])


def _permute_rotary(part: np.ndarray, width: int, order: np.ndarray) -> np.ndarray:
    """``part`` with its last ``width`` features (of its last axis) taken in ``order``."""
    return np.concatenate([part[..., :-width], part[..., -width:][..., order]], axis=-1)


def _key(entry: Any) -> str | int:
    """A pure dict's key from a JAX tree path entry."""
    return entry.key if hasattr(entry, "key") else entry.idx


def _part_shape(shape: tuple[int, ...], index: tuple[Any, ...]) -> tuple[int, ...]:
    return np.broadcast_to(np.empty((), np.int8), shape)[index].shape


def _fill(template: str, names: dict[str, str], **more: Any) -> str:
    return template.format(**names, **more)


def tensor_rules(
    family: str,
    leaves: dict[str, dict[tuple[str | int, ...], tuple[int, ...]]],
    interleaved_rotary: int = 0,
) -> dict[str, TensorRule]:
    """Every transformers tensor of the model whose jaxmoe leaves are ``leaves``
    (collection -> leaf path -> shape), in the order transformers lists them: the
    embedding, the layers in order (the MTP layers last), the final norm, the head.
    ``interleaved_rotary``: the rotary width of the projections whose rotated features
    are stored in interleaved pairs (0: none are)."""
    names = FAMILY_NAMES[family]
    block_tensors = {**BLOCK_TENSORS, **FAMILY_BLOCK_TENSORS.get(family, {})}
    layers = 1 + max(
        (path[1] for paths in leaves.values() for path in paths if path[0] == "blocks"), default=-1
    )
    rules: list[TensorRule] = []
    for collection, paths in leaves.items():
        for path, shape in paths.items():
            if path[0] == "blocks":
                layer, key = path[1], ".".join(str(k) for k in path[2:])
                parts, prefix = block_tensors.get(key), f"model.layers.{layer}."
            elif path[0] == "mtp" and path[2] == "block":
                key = ".".join(str(k) for k in path[3:])
                parts, prefix = block_tensors.get(key), f"model.layers.{layers + path[1]}."
            elif path[0] == "mtp":
                key = ".".join(str(k) for k in path[2:])
                parts, prefix = MTP_TENSORS.get(key), f"model.layers.{layers + path[1]}."
            else:
                key = ".".join(str(k) for k in path)
                parts, prefix = MODEL_TENSORS.get(key), ""
            if parts is None:
                where = ".".join(str(k) for k in path)
                raise ConfigError(
                    f"the jaxmoe {collection} leaf {where} has no transformers tensor in "
                    "jaxmoe/hf/tensors.py: this model cannot be converted until the table "
                    "has a row for it"
                )
            rules.extend(_expand(parts, names, prefix, collection, path, shape, interleaved_rotary))
    _check_tiling(rules, leaves)
    rules.extend(_mtp_copies(leaves, layers))
    return {rule.name: rule for rule in sorted(rules, key=_order)}


def _expand(parts, names, prefix, collection, path, shape, interleaved_rotary) -> list[TensorRule]:
    """The rules of one leaf's parts, a part naming ``{e}`` once per expert."""
    rules = []
    for part in parts:
        experts = range(shape[0]) if "{e}" in part.name else [None]
        for e in experts:
            index = tuple(e if i == "{e}" else i for i in part.index)
            rules.append(
                TensorRule(
                    name=prefix + _fill(part.name, names, e=e),
                    collection=collection,
                    path=path,
                    index=index,
                    part_shape=_part_shape(shape, index),
                    layout=part.layout,
                    dims=tuple(_fill(dim, names) for dim in part.dims),
                    interleaved=interleaved_rotary if part.rotary else 0,
                )
            )
    return rules


def _mtp_copies(leaves, layers: int) -> list[TensorRule]:
    """The copies of the model's embedding and head each MTP layer stores."""
    params = leaves.get("params", {})
    modules = sorted({path[1] for path in params if path[0] == "mtp"})
    rules = []
    for module in modules:
        for tensor, candidates in MTP_COPIES.items():
            path = next(tuple(c.split(".")) for c in candidates if tuple(c.split(".")) in params)
            (rule,) = _expand(
                MODEL_TENSORS[".".join(path)], {}, "", "params", path, params[path], 0
            )
            rules.append(
                dataclasses.replace(
                    rule, name=f"model.layers.{layers + module}.{tensor}", copy=True
                )
            )
    return rules


def _check_tiling(rules: list[TensorRule], leaves) -> None:
    """The parts of each leaf add up to the leaf (the table covers every element)."""
    sizes: dict[tuple, int] = {}
    for rule in rules:
        key = (rule.collection, rule.path)
        sizes[key] = sizes.get(key, 0) + math.prod(rule.part_shape)
    for collection, paths in leaves.items():
        for path, shape in paths.items():
            if sizes.get((collection, path)) != math.prod(shape):
                raise ConfigError(
                    f"jaxmoe/hf/tensors.py: the parts of {'.'.join(map(str, path))} do not cover it"
                )


def _order(rule: TensorRule) -> tuple:
    """transformers' order: the embedding, the layers (by number, experts by number too),
    the final norm, the head."""
    name = rule.name
    group = ["model.embed_tokens.", "model.layers.", "model.norm.", ""]
    rank = next(i for i, prefix in enumerate(group) if name.startswith(prefix))
    return (rank, tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")))


def leaf_shapes(tree: Any) -> dict[tuple[str | int, ...], tuple[int, ...]]:
    """Leaf path -> shape of a pure dict (of arrays or ``ShapeDtypeStruct``)."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(_key(entry) for entry in path): tuple(leaf.shape) for path, leaf in flat}
