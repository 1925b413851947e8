"""Flax NNX modules of the GPT-MoE model, one concept per file."""

from jaxmoe.layers.moe import MoELayer, RoutingStats
from jaxmoe.layers.transformer import Block, GPTMoE

__all__ = ["Block", "GPTMoE", "MoELayer", "RoutingStats"]
