"""The largest arrays a configuration makes, counted before anything is built.

XLA stores an array's element count in a signed 64-bit integer: a shape whose
product overflows it aborts the process deep inside the compiler ("overflow in static
extent product"). :func:`check_array_sizes` refuses such a configuration first, in one
line naming the fields; :mod:`jaxmoe.plan.host_memory` then checks what does exist
against the host's memory. Counted here: every parameter (a weight's or an
embedding's shape), and the activations of the largest kind (the attention
scores, the logits, the expert buffers), over the global batch.
"""

from __future__ import annotations

import math

from jaxmoe.config.checks import ConfigError
from jaxmoe.config.model import ModelConfig
from jaxmoe.config.moe import MoEConfig
from jaxmoe.config.train import TrainConfig

# The largest element count of one array, with room for the bytes of an 8-byte element.
MAX_ELEMENTS = 2**63 // 8


# Each dimension: the field it comes from ("" for a constant), its size.
Shape = tuple[tuple[str, int], ...]


def array_shapes(model: ModelConfig, moe: MoEConfig, train: TrainConfig) -> dict[str, Shape]:
    """The largest arrays of a run, each as its dimensions named by the fields they come
    from (global shapes: the batch is the whole batch, experts all experts)."""
    return {**parameter_shapes(model, moe), **activation_shapes(model, moe, train)}


def parameter_shapes(model: ModelConfig, moe: MoEConfig) -> dict[str, Shape]:
    """The largest weights."""
    d_expert = moe.d_expert or model.d_ff
    d_expert_field = "moe.d_expert" if moe.d_expert else "model.d_ff"
    width = ("model.d_model", model.d_model)
    return {
        "the token embedding": (("model.vocab_size", model.vocab_size), width),
        "the attention projections": (width, width, ("", 3)),  # query, key and value
        "the dense FFN weights": (width, ("model.d_ff", model.d_ff)),
        "the expert weights": (
            ("moe.num_experts", moe.num_experts),
            width,
            (d_expert_field, d_expert),
        ),
    }


def activation_shapes(model: ModelConfig, moe: MoEConfig, train: TrainConfig) -> dict[str, Shape]:
    """The largest activations of one step."""
    d_expert = moe.d_expert or model.d_ff
    d_expert_field = "moe.d_expert" if moe.d_expert else "model.d_ff"
    batch = ("train.batch_size", train.batch_size)
    seq = ("model.seq_len", model.seq_len)
    width = ("model.d_model", model.d_model)
    return {
        "the batch": (batch, seq),
        "the attention scores": (batch, ("model.num_heads", model.num_heads), seq, seq),
        "the logits": (batch, seq, ("model.vocab_size", model.vocab_size)),
        "the expert buffers": (batch, seq, ("moe.top_k", moe.top_k), width),
        "the expert hidden activations": (
            batch,
            seq,
            ("moe.top_k", moe.top_k),
            (d_expert_field, d_expert),
        ),
    }


def check_array_sizes(model: ModelConfig, moe: MoEConfig, train: TrainConfig) -> None:
    """Refuse a configuration with an array that cannot exist (its element count overflows
    XLA's 64-bit extents), naming the array and the fields it comes from."""
    for what, dimensions in array_shapes(model, moe, train).items():
        elements = math.prod(size for _, size in dimensions)
        if elements > MAX_ELEMENTS:
            values = dict(reversed(dimensions))  # a field named twice: its first size
            fields = ", ".join(f"{name}={values[name]}" for name in dict(dimensions) if name)
            raise ConfigError(
                f"{what} would have {elements:.3g} elements ({fields}), more than any array "
                f"can hold (2^60): make these fields smaller"
            )
