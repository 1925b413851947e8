"""Model FLOPs of one training step, counted from the configuration.

The count follows the usual model-FLOPs conventions (Kaplan et al. 2020,
"Scaling Laws for Neural Language Models", section 2.1; Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", appendix; Chowdhery et al. 2022, "PaLM", appendix B):

- Only matrix multiplications count, at 2 FLOPs per multiply-add: ``[m, k] @
  [k, n]`` is ``2 m k n``. Norms, softmax, GELU, biases, residuals, the loss and
  the optimizer are left out.
- The backward pass is twice the forward pass (the gradients of both operands of
  every matmul), so a step is 3 x forward.
- Attention's projections count each matrix at its shape: queries ``d_model x heads x
  head_dim``, keys and values ``d_model x kv_heads x head_dim`` each (grouped-query
  attention has fewer), the output ``heads x head_dim x d_model``.
- Multi-head latent attention (DeepSeek) counts its matrices at their shapes too: the
  queries' compression ``d_model x q_lora_rank`` and expansion ``q_lora_rank x heads x
  (qk_nope_head_dim + qk_rope_head_dim)`` (or one ``d_model x heads x (...)`` matrix),
  the keys' and values' compression ``d_model x (kv_lora_rank + qk_rope_head_dim)`` and
  expansion ``kv_lora_rank x heads x (qk_nope_head_dim + v_head_dim)``, the output
  ``heads x v_head_dim x d_model``; its scores are ``qk_nope_head_dim + qk_rope_head_dim``
  wide a head, its weighted values ``v_head_dim``.
- Attention's two matmuls (query-key scores, weights x values) count the whole
  ``seq x seq`` matrix, ``4 seq heads head_dim`` per token and layer, although the
  causal mask makes half of it irrelevant: PaLM's MFU (``6N + 12 L H Q T`` per token)
  and Megatron-LM's count do the same (the dense attention core computes the full
  matrix; the blockwise and cuDNN cores skip the masked tiles). MaxText now counts only
  the unmasked half; this count does not halve it (halving would lower the attention
  term, and MFU, accordingly).
- Feed-forward blocks count two matrices (GELU) or three (SwiGLU's gate, up and down),
  for the dense FFN, the routed experts and the shared experts alike.
- The token embedding is a lookup (no FLOPs); the output head, tied to it or not, is
  a ``d_model x vocab`` matmul per token and counts.
- Multi-token prediction (``model.mtp_depth`` modules, DeepSeek-V3) counts each module's
  projection ``2 d_model x d_model``, its block (attention and FFN or MoE, counted with
  the layers') and its pass through the output head, per token, as Megatron-Core counts
  them.
- An MoE layer counts its router (``d_model x num_experts`` per token) and the
  ``top_k`` experts each token is routed to: the active parameters only. What the
  implementation computes beyond that is not model FLOPs: the empty capacity slots
  that the expert GEMMs run over (capacity padding, and dropless mode's
  ``num_experts / top_k`` times larger buffers), and the weighted sum that combines
  a token's ``top_k`` outputs. Dropped assignments are not model FLOPs either: the
  experts never compute them. A configuration cannot know how many will drop, so
  :meth:`ModelFlops.train_step` takes the fraction a step measured (``dropped_fraction``
  in the metrics); without it every assignment counts as kept. Shared experts see every
  token: they count in full.

The count does not depend on the parallel layout: it is the work of the whole
step, over every device.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from jaxmoe.config import Config, ModelConfig
from jaxmoe.config.moe import shared_width

# Forward + backward: the backward pass computes both operands' gradients of each matmul.
TRAIN_STEP_FACTOR = 3


@dataclass(frozen=True)
class ModelFlops:
    """Forward model FLOPs of one step's tokens (``batch_size x seq_len``), by part."""

    attention_projections: int  # query, key, value and output projections
    attention_matmuls: int  # scores and weighted values, the full seq x seq matrix
    dense_ffn: int  # the FFN of the layers that are not MoE layers
    router: int
    experts: int  # top_k experts per token, every assignment kept
    shared_experts: int
    output_head: int  # the model's and each multi-token prediction module's
    multi_token_projections: int = 0  # each module's 2 d_model -> d_model projection

    @property
    def forward(self) -> int:
        return sum(getattr(self, part.name) for part in fields(self))

    def train_step(self, dropped_fraction: float = 0.0) -> float:
        """Forward and backward FLOPs of a step whose MoE layers dropped
        ``dropped_fraction`` of their assignments (all MoE layers together: they all
        have the same cost per assignment)."""
        if not 0.0 <= dropped_fraction <= 1.0:
            raise ValueError(f"dropped_fraction={dropped_fraction!r}: must be in [0, 1]")
        kept = self.forward - dropped_fraction * self.experts
        return TRAIN_STEP_FACTOR * kept


def model_flops(config: Config) -> ModelFlops:
    """The forward model FLOPs of one training step of ``config`` (see the module notes)."""
    model, moe = config.model, config.moe
    tokens = config.train.batch_size * model.seq_len
    width = model.d_model
    layers = model.num_layers + model.mtp_depth  # the modules' blocks with the layers
    moe_layers = len(model.moe_layers)
    d_expert = moe.d_expert or model.d_ff
    heads = model.num_heads * model.attention_head_dim  # all query heads, side by side
    values = model.num_heads * model.value_head_dim
    matrices = 3 if model.activation == "swiglu" else 2  # per feed-forward block

    def matmul(rows: int, contracted: int, columns: int) -> int:
        return 2 * rows * contracted * columns

    return ModelFlops(
        attention_projections=layers * _attention_projections(model, tokens),
        attention_matmuls=layers
        * (matmul(tokens, heads, model.seq_len) + matmul(tokens, values, model.seq_len)),
        dense_ffn=(layers - moe_layers) * matrices * matmul(tokens, width, model.d_ff),
        # The router's logits, and Qwen-MoE's gate on the shared experts.
        router=moe_layers * matmul(tokens, width, moe.num_experts + moe.shared_expert_gate),
        experts=moe_layers * matrices * matmul(tokens * moe.top_k, width, d_expert),
        shared_experts=moe_layers * matrices * matmul(tokens, width, shared_width(model, moe)),
        output_head=(1 + model.mtp_depth) * matmul(tokens, width, model.vocab_size),
        multi_token_projections=model.mtp_depth * matmul(tokens, 2 * width, width),
    )


def _attention_projections(model: ModelConfig, tokens: int) -> int:
    """One layer's attention projections on ``tokens`` tokens (module notes)."""
    width, heads = model.d_model, model.num_heads
    query = heads * model.attention_head_dim
    out = 2 * tokens * heads * model.value_head_dim * width
    if not model.latent_attention:
        key_value = 2 * model.kv_heads * model.attention_head_dim
        return 2 * tokens * width * (query + key_value) + out
    assert model.kv_lora_rank is not None and model.qk_nope_head_dim is not None
    rank, rope = model.kv_lora_rank, model.rotary_head_dim
    if model.q_lora_rank is None:
        queries = 2 * tokens * width * query
    else:
        queries = 2 * tokens * model.q_lora_rank * (width + query)
    keys_values = (
        2
        * tokens
        * (width * (rank + rope) + rank * heads * (model.qk_nope_head_dim + model.value_head_dim))
    )
    return queries + keys_values + out
