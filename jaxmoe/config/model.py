"""The model section: a decoder-only transformer whose FFN is a Mixture of Experts in
chosen layers, with the blocks of the model families it covers.

Two families of blocks share one configuration. The GPT-2 family (the default):
LayerNorm, learned positions, multi-head attention with a fused bias-free projection,
GELU FFNs with biases, the output head tied to the token embedding. The
Llama-derived families (Mixtral, Qwen-MoE, DeepSeek-style; the presets in
:mod:`jaxmoe.presets`): RMSNorm, rotary positions, grouped-query attention, SwiGLU
FFNs without biases, an untied output head. Each block is its own field, so the
families are presets, not code paths.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmoe.config import choices
from jaxmoe.config.checks import check_types, one_of, positive_int, require


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the decoder and the kind of each of its blocks."""

    # Token ids the embedding holds: at least 256 for the default byte-level corpus, at
    # least a tokenized corpus's vocabulary.
    vocab_size: int = 256
    # Width of the residual stream (and of the token embedding).
    d_model: int = 128
    # Attention heads (query heads, under grouped-query attention).
    num_heads: int = 4
    # Transformer blocks.
    num_layers: int = 4
    # Hidden width of the dense FFN (and of each expert unless moe.d_expert says otherwise).
    d_ff: int = 512
    # Tokens per training sequence.
    seq_len: int = 128
    # Layers k-1, 2k-1, ... (counted from 0) are MoE layers, k this field (Lancet and
    # GShard use k = 2; Mixtral and Qwen 1), except the first ``first_dense_layers``.
    moe_every: int = 2
    # The first this many layers are dense whatever moe_every says (DeepSeek-V3: 3).
    first_dense_layers: int = 0
    # Compute dtype of activations and of the parameters as they enter each matmul:
    # "bfloat16" is mixed precision (the parameters, their gradients and the optimizer
    # state stay float32; the router, the logits and the loss are float32).
    dtype: str = "float32"
    # FP8 training: the attention, dense and expert GEMMs (forward and both gradients)
    # take float8_e4m3fn operands with float32 accumulation, scaled "tensorwise" (one scale
    # per operand) or "blockwise" (DeepSeek-V3: 1 x 128 tiles of activations, 128 x 128
    # blocks of weights; the weight gradient's operands one scale per feature); the
    # parameters, optimizer state, attention core, router and head keep model.dtype.
    # "none": off. jaxmoe/layers/fp8.py.
    fp8: str = "none"
    # The backward pass recomputes this instead of keeping its activations: "none" (the
    # norms and activations keep only their inputs: jaxmoe/layers/input_kept.py),
    # "attention" (the dense core's softmax weights, O(seq^2) per head; the blockwise and
    # cuDNN cores never keep them), "matmuls" (all but the results of the matmuls, the
    # exchanges and the flash attention core: norms, activations), "matmuls_offload" (the
    # same, what is kept held in host memory: GPU and TPU), or "layer" (every block from its
    # input, which is all a block keeps). jaxmoe/layers/recompute.py.
    recompute: str = "none"
    # The attention core (jaxmoe/layers/attention_core.py): "auto" (cuDNN's flash
    # attention on a GPU that takes the shapes, else blockwise), "blockwise" (flash
    # attention in JAX, on every backend), "cudnn" or "dense" (every score materialised:
    # the reference).
    attention: str = "auto"
    # blockwise: the tile of queries and keys, in positions (at most this many scores a
    # head at once: the tile's square).
    attention_block: int = 512
    # Keys a query sees, itself included (Mistral's sliding window); None: every earlier
    # one.
    sliding_window: int | None = None
    # "layernorm" (with a bias, GPT-2) or "rmsnorm" (Llama, Mixtral, Qwen, DeepSeek).
    norm: str = "layernorm"
    # The epsilon of every norm (usually 1e-5 or 1e-6).
    norm_eps: float = 1e-6
    # "learned" (an embedding per position, GPT-2) or "rope" (rotary, on query and key).
    position: str = "learned"
    # rope: the base theta of the rotary frequencies, theta^(-2i / head_dim).
    rope_theta: float = 10000.0
    # Rotary scaling for contexts beyond the trained one: "none", "linear" (position
    # interpolation: positions divided by rope_scaling_factor) or "yarn" (YaRN, as in
    # DeepSeek-V3: frequencies interpolated by band, attention scaled).
    rope_scaling: str = "none"
    # linear and yarn: the scaling factor (1: no scaling).
    rope_scaling_factor: float = 1.0
    # yarn: the context the model was trained on before scaling.
    rope_original_seq_len: int = 4096
    # Key/value heads: grouped-query attention shares each among num_heads / num_kv_heads
    # query heads (Mixtral 8, Qwen3-MoE 4); None: one per query head (multi-head).
    num_kv_heads: int | None = None
    # Width of one head; None: d_model / num_heads (Qwen3 sets 128 whatever the width).
    head_dim: int | None = None
    # Biases on the query, key and value projections (Qwen2).
    attention_bias: bool = False
    # Biases on the other linear layers: attention's output, the FFNs and the experts
    # (GPT-2); the Llama-derived families have none.
    linear_bias: bool = True
    # RMSNorm over each query and key head before the rotation (Qwen3).
    qk_norm: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3) when set: keys and values of every
    # head expanded from one compressed latent of this width a token (with its RMSNorm);
    # the decode cache holds the latent and the rotary key alone. None: grouped-query
    # attention. jaxmoe/layers/latent_attention.py.
    kv_lora_rank: int | None = None
    # MLA: queries through a compression of this width (with its RMSNorm); None: one
    # projection from the residual stream (DeepSeek-V2-Lite).
    q_lora_rank: int | None = None
    # MLA: each head's query and key features without rotary positions (DeepSeek-V3: 128).
    qk_nope_head_dim: int | None = None
    # MLA: each head's rotated query features, and the rotated key's, one a token shared
    # by the heads (DeepSeek-V3: 64).
    qk_rope_head_dim: int | None = None
    # MLA: each head's value width (DeepSeek-V3: 128).
    v_head_dim: int | None = None
    # yarn: DeepSeek's mscale (0: not given), with m(s, a) = 0.1 a ln(s) + 1 for the factor
    # s: with rope_mscale_all_dim too, the rotated features are scaled by m(s, mscale) /
    # m(s, mscale_all_dim) instead of m(s, 1).
    rope_mscale: float = 0.0
    # yarn: DeepSeek's mscale_all_dim (0: not given): multi-head latent attention
    # multiplies its softmax scale by m(s, mscale_all_dim)^2.
    rope_mscale_all_dim: float = 0.0
    # "gelu" (two matrices and biases, GPT-2) or "swiglu" (gate, up and down matrices
    # without biases: silu(x W_gate) * (x W_up) W_down) for the dense FFN and the experts.
    activation: str = "gelu"
    # The output head is the token embedding, transposed (GPT-2), or a matrix of its own.
    tie_embeddings: bool = True
    # Multi-token prediction (DeepSeek-V3): this many sequential modules after the last
    # layer, module k predicting the token k + 1 places ahead from the previous module's
    # hidden state and the embedding of the token k places ahead (each: two norms, a
    # projection of their concatenation, one block, a norm; the embedding and the output
    # head shared). 0: none. jaxmoe/layers/multi_token.py.
    mtp_depth: int = 0
    # The weight of the multi-token prediction loss (the mean over the modules) in the
    # total loss (DeepSeek-V3: 0.3, then 0.1).
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        check_types("model", self)
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "seq_len"):
            positive_int("model", name, getattr(self, name))
        positive_int("model", "moe_every", self.moe_every)
        require(
            isinstance(self.first_dense_layers, int) and self.first_dense_layers >= 0,
            f"model.first_dense_layers={self.first_dense_layers!r}: must be an integer >= 0",
        )
        require(
            isinstance(self.mtp_depth, int) and 0 <= self.mtp_depth < self.seq_len,
            f"model.mtp_depth={self.mtp_depth!r}: must be an integer from 0 (no multi-token "
            f"prediction) to model.seq_len - 1 = {self.seq_len - 1}",
        )
        require(
            self.mtp_loss_weight >= 0,
            f"model.mtp_loss_weight={self.mtp_loss_weight!r}: must be >= 0",
        )
        require(
            bool(self._moe_layers_among(range(self.num_layers))),
            f"model.moe_every={self.moe_every} and model.first_dense_layers="
            f"{self.first_dense_layers} leave no MoE layer among model.num_layers="
            f"{self.num_layers}: use fewer dense layers or a smaller moe_every",
        )
        one_of("model", "dtype", self.dtype, choices.DTYPES)
        one_of("model", "fp8", self.fp8, choices.FP8_RECIPES)
        one_of("model", "recompute", self.recompute, choices.RECOMPUTE)
        one_of("model", "attention", self.attention, choices.ATTENTION)
        positive_int("model", "attention_block", self.attention_block)
        if self.sliding_window is not None:
            positive_int("model", "sliding_window", self.sliding_window)
        one_of("model", "norm", self.norm, choices.NORMS)
        one_of("model", "position", self.position, choices.POSITIONS)
        one_of("model", "rope_scaling", self.rope_scaling, choices.ROPE_SCALINGS)
        one_of("model", "activation", self.activation, choices.ACTIVATIONS)
        require(self.norm_eps > 0, f"model.norm_eps={self.norm_eps!r}: must be > 0 (1e-5 or 1e-6)")
        require(self.rope_theta > 0, f"model.rope_theta={self.rope_theta!r}: must be > 0")
        require(
            self.rope_scaling_factor >= 1,
            f"model.rope_scaling_factor={self.rope_scaling_factor!r}: must be >= 1 (1: no scaling)",
        )
        positive_int("model", "rope_original_seq_len", self.rope_original_seq_len)
        if self.head_dim is None:
            require(
                self.d_model % self.num_heads == 0,
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads}: choose a width that is a multiple of the number of heads, "
                "or set model.head_dim",
            )
        else:
            positive_int("model", "head_dim", self.head_dim)
        for name in ("rope_mscale", "rope_mscale_all_dim"):
            require(
                getattr(self, name) >= 0,
                f"model.{name}={getattr(self, name)!r}: must be >= 0 (0: not given)",
            )
        self._check_latent_attention()
        require(
            self.position != "rope" or self.rotary_head_dim % 2 == 0,
            f"model.{'qk_rope_head_dim' if self.latent_attention else 'head_dim'}="
            f"{self.rotary_head_dim}: rotary positions rotate pairs of features, so it "
            "needs an even width",
        )
        if self.num_kv_heads is not None:
            positive_int("model", "num_kv_heads", self.num_kv_heads)
            require(
                self.num_heads % self.num_kv_heads == 0,
                f"model.num_kv_heads={self.num_kv_heads} does not divide model.num_heads="
                f"{self.num_heads}: each key/value head serves a whole number of query heads",
            )

    def _check_latent_attention(self) -> None:
        dims = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.latent_attention:
            for name in ("q_lora_rank", *dims):
                require(
                    getattr(self, name) is None,
                    f"model.{name}={getattr(self, name)!r}: a field of multi-head latent "
                    "attention, which model.kv_lora_rank turns on: set it, or leave this unset",
                )
            return
        positive_int("model", "kv_lora_rank", self.kv_lora_rank)
        if self.q_lora_rank is not None:
            positive_int("model", "q_lora_rank", self.q_lora_rank)
        for name in dims:
            require(
                getattr(self, name) is not None,
                f"model.{name} is unset: multi-head latent attention (model.kv_lora_rank) "
                "needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim",
            )
            positive_int("model", name, getattr(self, name))
        refused = {
            "position": (self.position != "rope", "its decoupled key is rotary: set rope"),
            "num_kv_heads": (
                self.num_kv_heads is not None,
                "its keys and values are per head: leave it unset",
            ),
            "head_dim": (
                self.head_dim is not None,
                "its widths are qk_nope_head_dim, qk_rope_head_dim and v_head_dim: leave it unset",
            ),
            "qk_norm": (self.qk_norm, "it norms its latents, not its heads: turn it off"),
            "attention_bias": (self.attention_bias, "it has no biases: turn it off"),
        }
        for name, (bad, fix) in refused.items():
            require(
                not bad,
                f"model.{name}={getattr(self, name)!r} with multi-head latent attention "
                f"(model.kv_lora_rank): {fix}",
            )

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def rotary_head_dim(self) -> int:
        """The rotated features of a query or key head."""
        if self.latent_attention:
            assert self.qk_rope_head_dim is not None
            return self.qk_rope_head_dim
        return self.attention_head_dim

    @property
    def value_head_dim(self) -> int:
        """The width of one value head (and of one head of attention's output)."""
        return self.v_head_dim or self.attention_head_dim

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose FFN is a Mixture of Experts, in depth order: the
        model's, then the multi-token prediction modules' blocks, numbered on after the
        last layer (as DeepSeek-V3's checkpoint numbers them)."""
        return self._moe_layers_among(range(self.num_layers + self.mtp_depth))

    def _moe_layers_among(self, layers: range) -> tuple[int, ...]:
        return tuple(
            i for i in layers if i >= self.first_dense_layers and (i + 1) % self.moe_every == 0
        )

    @property
    def attention_head_dim(self) -> int:
        """The width of one query or key head."""
        if self.latent_attention:
            assert self.qk_nope_head_dim is not None and self.qk_rope_head_dim is not None
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``num_heads`` without grouped-query attention)."""
        return self.num_kv_heads or self.num_heads
