"""Flax NNX modules of the GPT-MoE model, one concept per file."""

from jaxmoe.layers.block import Block
from jaxmoe.layers.moe import MoELayer, RoutingStats
from jaxmoe.layers.transformer import GPTMoE

__all__ = ["Block", "GPTMoE", "MoELayer", "RoutingStats"]
