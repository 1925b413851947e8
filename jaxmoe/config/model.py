"""The model section: a GPT-style decoder with an MoE FFN every ``moe_every`` layers."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmoe.config import choices
from jaxmoe.config.checks import check_types, one_of, positive_int, require


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder whose FFN is a Mixture of Experts every ``moe_every`` layers."""

    vocab_size: int = 256
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    d_ff: int = 512
    seq_len: int = 128
    # Layers k-1, 2k-1, ... are MoE layers (Lancet and GShard use k = 2).
    moe_every: int = 2
    # Compute dtype of activations; parameters and the optimizer stay in float32.
    dtype: str = "float32"
    # The backward pass recomputes this instead of keeping its activations: "none", or
    # "attention" (softmax(QK^T) V, whose weights are O(seq^2) per head).
    recompute: str = "none"

    def __post_init__(self) -> None:
        check_types("model", self)
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "seq_len"):
            positive_int("model", name, getattr(self, name))
        positive_int("model", "moe_every", self.moe_every)
        require(
            self.moe_every <= self.num_layers,
            f"model.moe_every={self.moe_every} is larger than model.num_layers="
            f"{self.num_layers}: the model would have no MoE layer; use at most num_layers",
        )
        require(
            self.d_model % self.num_heads == 0,
            f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}: "
            "choose a width that is a multiple of the number of heads",
        )
        one_of("model", "dtype", self.dtype, choices.DTYPES)
        one_of("model", "recompute", self.recompute, choices.RECOMPUTE)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose FFN is a Mixture of Experts."""
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.moe_every == 0)
