"""Small decoding models of the GPT-2 family and of the Llama-derived ones, built once per
test process, and their full forward pass (the reference of cached decoding)."""

import dataclasses
import functools

import jax
from flax import nnx

from jaxmoe.generate import inference_moe
from jaxmoe.layers import GPTMoE
from jaxmoe.presets import preset

# tiny: learned positions, LayerNorm, GELU, top-1; mixtral-tiny: rotary, GQA, SwiGLU,
# top-2; qwen3_moe-tiny: rotary, GQA, query/key norms, a head width of its own, top-4;
# deepseek_v3-tiny: multi-head latent attention (its latent cache), group-limited routing.
FAMILIES = ("tiny", "mixtral-tiny", "qwen3_moe-tiny", "deepseek_v3-tiny")
SEQ_LEN = 16


@functools.cache
def small_model(name: str) -> GPTMoE:
    """The preset cut to 2 layers (one of them MoE) and 16 positions, dropless."""
    config = preset(name)
    model = dataclasses.replace(config.model, num_layers=2, seq_len=SEQ_LEN)
    return GPTMoE(model, inference_moe(config.moe), rngs=nnx.Rngs(7))


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)[0]


def full_logits(model: GPTMoE, tokens) -> jax.Array:
    """The forward pass over whole rows ``[batch, seq]``: logits ``[batch, seq, vocab]``."""
    graphdef, state = nnx.split(model)
    return _full_logits(graphdef, state, tokens)
