"""Named configurations: the GPT-2 family's, and the model families people train today.

``tiny`` is the default: its loss visibly falls within a couple of minutes on a 2-core
CPU host with 8 fake devices. Each family (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3
style) is a function of its shape, giving a ``<family>-tiny`` preset of the same
blocks that trains on 8 fake CPU devices in the demo's time, and the published full
shapes for the planner (sources beside each; far too large to train on a CPU host).
The full shapes run bfloat16 activations, sequences of 4096 tokens, capacity factor 1.0
(dropless training is ``--moe.capacity_factor none``).
"""

from __future__ import annotations

import dataclasses

from jaxmoe.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)

# The blocks the Llama-derived families share: RMSNorm, rotary positions, SwiGLU
# without biases, an untied output head.
_LLAMA_BLOCKS = dict(
    norm="rmsnorm",
    position="rope",
    activation="swiglu",
    linear_bias=False,
    tie_embeddings=False,
)
# A tiny model's shape and training, shared by the -tiny presets: the byte-level corpus.
_TINY_MODEL = dict(vocab_size=256, d_model=128, num_heads=4, num_layers=4, seq_len=64)
_TINY_TRAIN = TrainConfig(batch_size=32, steps=200, learning_rate=3e-3, warmup_steps=20)
_FULL_SEQ_LEN = 4096


def mixtral(
    *,
    num_kv_heads: int,
    d_ff: int,
    experts: int = 8,
    top_k: int = 2,
    rope_theta: float = 1e6,
    norm_eps: float = 1e-5,
    **model,
) -> tuple[ModelConfig, MoEConfig]:
    """Mixtral: every layer an MoE layer of SwiGLU experts, softmax top-2 renormalised."""
    return (
        ModelConfig(
            **_LLAMA_BLOCKS,
            moe_every=1,
            d_ff=d_ff,
            num_kv_heads=num_kv_heads,
            rope_theta=rope_theta,
            norm_eps=norm_eps,
            **model,
        ),
        MoEConfig(num_experts=experts, top_k=top_k, normalize_top_k=True, capacity_factor=1.0),
    )


def qwen2_moe(
    *,
    num_kv_heads: int,
    d_expert: int,
    d_shared: int,
    experts: int,
    top_k: int,
    rope_theta: float = 1e6,
    **model,
) -> tuple[ModelConfig, MoEConfig]:
    """Qwen2-MoE: biases on query, key and value; fine-grained experts beside one gated
    shared expert; softmax top-k without renormalisation (``norm_topk_prob`` false)."""
    return (
        ModelConfig(
            **_LLAMA_BLOCKS,
            moe_every=1,
            d_ff=d_expert,
            num_kv_heads=num_kv_heads,
            attention_bias=True,
            rope_theta=rope_theta,
            **model,
        ),
        MoEConfig(
            num_experts=experts,
            top_k=top_k,
            normalize_top_k=False,
            capacity_factor=1.0,
            d_expert=d_expert,
            num_shared_experts=1,
            d_shared_expert=d_shared,
            shared_expert_gate=True,
        ),
    )


def qwen3_moe(
    *,
    num_kv_heads: int,
    head_dim: int,
    d_expert: int,
    experts: int,
    top_k: int,
    rope_theta: float = 1e6,
    **model,
) -> tuple[ModelConfig, MoEConfig]:
    """Qwen3-MoE: query and key norms, a head width of its own, fine-grained experts, no
    shared expert, softmax top-k renormalised."""
    return (
        ModelConfig(
            **_LLAMA_BLOCKS,
            moe_every=1,
            d_ff=d_expert,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            qk_norm=True,
            rope_theta=rope_theta,
            **model,
        ),
        MoEConfig(
            num_experts=experts,
            top_k=top_k,
            normalize_top_k=True,
            capacity_factor=1.0,
            d_expert=d_expert,
        ),
    )


def deepseek_v3(
    *,
    num_kv_heads: int,
    head_dim: int,
    d_ff: int,
    d_expert: int,
    experts: int,
    top_k: int,
    groups: int,
    top_groups: int,
    first_dense_layers: int,
    **model,
) -> tuple[ModelConfig, MoEConfig]:
    """DeepSeek-V3 style: leading dense layers, fine-grained experts beside one shared
    expert, sigmoid scores with auxiliary-loss-free balancing (a per-expert selection bias
    moved by 0.001 a step), group-limited routing, the routed weights renormalised and
    scaled by 2.5, a small sequence-wise balance loss. Multi-head latent attention is not
    implemented: grouped-query attention takes its place (the number of key/value heads
    is this configuration's choice, not the model's)."""
    return (
        ModelConfig(
            **_LLAMA_BLOCKS,
            moe_every=1,
            first_dense_layers=first_dense_layers,
            d_ff=d_ff,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            **model,
        ),
        MoEConfig(
            num_experts=experts,
            top_k=top_k,
            capacity_factor=1.0,
            d_expert=d_expert,
            num_shared_experts=1,
            score_function="sigmoid",
            normalize_top_k=True,
            routed_scaling_factor=2.5,
            num_expert_groups=groups,
            top_k_expert_groups=top_groups,
            expert_bias_rate=0.001,
            aux_loss_coef=0.0,
            z_loss_coef=0.0,
            seq_aux_loss_coef=1e-4,
        ),
    )


def _preset(model: ModelConfig, moe: MoEConfig, train: TrainConfig, **sections) -> Config:
    return Config(model=model, moe=moe, train=train, **sections)


def _tiny(model: ModelConfig, moe: MoEConfig) -> Config:
    return _preset(model, moe, _TINY_TRAIN, parallel=ParallelConfig(data=1, expert=8))


def _full(model: ModelConfig, moe: MoEConfig, devices: int = 8) -> Config:
    """A published shape for the planner: bfloat16, 4096-token sequences, a sequence per
    device (``jaxmoe plan`` lays it out on its own device count)."""
    model = dataclasses.replace(model, seq_len=_FULL_SEQ_LEN, dtype="bfloat16")
    return _preset(
        model,
        moe,
        TrainConfig(batch_size=devices, learning_rate=3e-4, warmup_steps=100),
        parallel=ParallelConfig(data=devices // 8, expert=8),
        data=DataConfig(max_bytes=None),
    )


PRESETS: dict[str, Config] = {
    # -- GPT-2 family --------------------------------------------------------------------------
    "tiny": Config(
        model=ModelConfig(d_model=128, num_heads=4, num_layers=4, d_ff=512, seq_len=64),
        moe=MoEConfig(num_experts=8, top_k=1, capacity_factor=1.25),
        parallel=ParallelConfig(data=1, expert=8),
        train=TrainConfig(batch_size=32, steps=200, learning_rate=3e-3, warmup_steps=20),
    ),
    "small": Config(
        model=ModelConfig(d_model=128, num_heads=4, num_layers=6, d_ff=512, seq_len=128),
        moe=MoEConfig(num_experts=16, top_k=2, capacity_factor=1.25),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=32, steps=500, learning_rate=2e-3, warmup_steps=50),
    ),
    # Lancet's GPT-2 MoE (12 layers, width 768, 16 heads, sequence 512, MoE every second
    # layer, top-1, capacity factor 1.0, experts = 2 x devices) on 8 devices. For the
    # scheduler and the simulator; far too large to train on a CPU host.
    "gpt2-moe-12": Config(
        model=ModelConfig(d_model=768, num_heads=16, num_layers=12, d_ff=3072, seq_len=512),
        moe=MoEConfig(num_experts=16, top_k=1, capacity_factor=1.0),
        parallel=ParallelConfig(data=1, expert=8),
        train=TrainConfig(batch_size=16, learning_rate=3e-4, warmup_steps=100),
        data=DataConfig(max_bytes=None),
    ),
    # -- The model families, tiny ---------------------------------------------------------------
    "mixtral-tiny": _tiny(*mixtral(num_kv_heads=2, d_ff=256, **_TINY_MODEL)),
    "qwen2_moe-tiny": _tiny(
        *qwen2_moe(num_kv_heads=2, d_expert=64, d_shared=256, experts=16, top_k=4, **_TINY_MODEL)
    ),
    "qwen3_moe-tiny": _tiny(
        *qwen3_moe(num_kv_heads=2, head_dim=32, d_expert=64, experts=16, top_k=4, **_TINY_MODEL)
    ),
    "deepseek_v3-tiny": _tiny(
        *deepseek_v3(
            num_kv_heads=2,
            head_dim=32,
            d_ff=256,
            d_expert=32,
            experts=32,
            top_k=4,
            groups=4,
            top_groups=2,
            first_dense_layers=1,
            **_TINY_MODEL,
        )
    ),
    # -- The model families, published shapes (the model's config.json on the Hugging Face
    # hub) ------------------------------------------------------------------------------------
    # mistralai/Mixtral-8x7B-v0.1: 32 layers, hidden 4096, 32 heads (8 KV), intermediate
    # 14336, 8 experts top-2, vocab 32000, rope_theta 1e6, rms_norm_eps 1e-5.
    "mixtral-8x7b": _full(
        *mixtral(
            num_kv_heads=8, d_ff=14336, vocab_size=32000, d_model=4096, num_heads=32, num_layers=32
        )
    ),
    # mistral-community/Mixtral-8x22B-v0.1: 56 layers, hidden 6144, 48 heads (8 KV),
    # intermediate 16384, 8 experts top-2, vocab 32000, rope_theta 1e6, rms_norm_eps 1e-5.
    "mixtral-8x22b": _full(
        *mixtral(
            num_kv_heads=8, d_ff=16384, vocab_size=32000, d_model=6144, num_heads=48, num_layers=56
        )
    ),
    # Qwen/Qwen2-57B-A14B: 28 layers, hidden 3584, 28 heads (4 KV), 64 experts top-8 of
    # moe_intermediate_size 2560, a shared expert of 20480, decoder_sparse_step 1,
    # norm_topk_prob false, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6.
    "qwen2_moe-57b-a14b": _full(
        *qwen2_moe(
            num_kv_heads=4,
            d_expert=2560,
            d_shared=20480,
            experts=64,
            top_k=8,
            vocab_size=151936,
            d_model=3584,
            num_heads=28,
            num_layers=28,
        )
    ),
    # Qwen/Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads (4 KV) of head_dim 128, 128
    # experts top-8 of moe_intermediate_size 768, norm_topk_prob true, vocab 151936,
    # rope_theta 1e6, rms_norm_eps 1e-6.
    "qwen3_moe-30b-a3b": _full(
        *qwen3_moe(
            num_kv_heads=4,
            head_dim=128,
            d_expert=768,
            experts=128,
            top_k=8,
            vocab_size=151936,
            d_model=2048,
            num_heads=32,
            num_layers=48,
        )
    ),
    # Qwen/Qwen3-235B-A22B: 94 layers, hidden 4096, 64 heads (4 KV) of head_dim 128, 128
    # experts top-8 of moe_intermediate_size 1536.
    "qwen3_moe-235b-a22b": _full(
        *qwen3_moe(
            num_kv_heads=4,
            head_dim=128,
            d_expert=1536,
            experts=128,
            top_k=8,
            vocab_size=151936,
            d_model=4096,
            num_heads=64,
            num_layers=94,
        )
    ),
    # deepseek-ai/DeepSeek-V3: 61 layers (the first 3 dense, intermediate 18432), hidden
    # 7168, 128 heads, 256 routed experts top-8 of moe_intermediate_size 2048 in 8 groups
    # (top 4 groups) beside 1 shared expert, sigmoid scores with a correction bias,
    # routed_scaling_factor 2.5, vocab 129280, rope_theta 10000 with YaRN (factor 40 over
    # 4096 positions). Grouped-query attention (128 heads of 128, 8 key/value heads: this
    # configuration's choice) in place of multi-head latent attention.
    "deepseek_v3-671b": _full(
        *deepseek_v3(
            num_kv_heads=8,
            head_dim=128,
            d_ff=18432,
            d_expert=2048,
            experts=256,
            top_k=8,
            groups=8,
            top_groups=4,
            first_dense_layers=3,
            vocab_size=129280,
            d_model=7168,
            num_heads=128,
            num_layers=61,
            rope_theta=10000.0,
            rope_scaling="yarn",
            rope_scaling_factor=40.0,
            rope_original_seq_len=4096,
        )
    ),
}


def preset(name: str) -> Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown preset {name!r}: choose one of {', '.join(sorted(PRESETS))}"
        ) from None
