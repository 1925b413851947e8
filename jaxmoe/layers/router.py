"""Top-k routing: scores, expert choice, and the router's auxiliary losses.

Shapes: tokens come in routing groups, ``[groups, group_size, d_model]``.
The router runs in float32 whatever the compute dtype: its softmax and the
z-loss are sensitive to rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx


class RouterOutput(NamedTuple):
    expert_index: jax.Array  # [groups, group_size, top_k] int32, best choice first
    combine_weight: jax.Array  # [groups, group_size, top_k] float32
    aux_loss: jax.Array  # scalar: load-balancing loss, mean over groups
    z_loss: jax.Array  # scalar: router z-loss, mean over tokens


def router_scores(logits: jax.Array, score_function: str) -> jax.Array:
    """Per-expert scores: softmax over experts, or an independent sigmoid per expert."""
    if score_function == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits)
    raise ValueError(f"unknown score function {score_function!r}")


def top_k_experts(
    logits: jax.Array, scores: jax.Array, top_k: int, normalize: bool
) -> tuple[jax.Array, jax.Array]:
    """The ``top_k`` highest-scoring experts per token and their combine weights.

    Experts are ranked by their logits, which order them as the scores do (both
    score functions are monotone in the logit) without the scores' rounding: a
    float32 sigmoid is exactly 1.0 above a logit of about 17, so ranking by
    scores would tie such experts falsely and hand the token to the lowest
    index. True ties go to the lower expert index (``lax.top_k`` is stable).
    The weights are the chosen experts' scores. With ``normalize`` and
    ``top_k > 1`` they are rescaled to sum to one (GShard, Mixtral); with
    ``top_k == 1`` the raw score is kept (Switch), so the task loss still
    trains the router.
    """
    chex.assert_equal_shape((logits, scores))
    _, index = jax.lax.top_k(logits, top_k)
    weights = jnp.take_along_axis(scores, index, axis=-1)
    if normalize and top_k > 1:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, index.astype(jnp.int32)


def load_balancing_loss(scores: jax.Array, expert_index: jax.Array, num_experts: int) -> jax.Array:
    """Switch/GShard auxiliary loss, ``num_experts * sum_e f_e * P_e``, averaged over groups.

    ``f_e`` is the fraction of the group's top-k assignments that chose expert
    ``e``; ``P_e`` the mean (normalised) score of expert ``e``. It is 1 when
    routing is uniform and grows as it concentrates.
    """
    probabilities = scores / jnp.sum(scores, axis=-1, keepdims=True)
    assignments = jax.nn.one_hot(expert_index, num_experts, dtype=jnp.float32)
    fraction_routed = jnp.mean(jnp.sum(assignments, axis=-2), axis=-2) / expert_index.shape[-1]
    mean_probability = jnp.mean(probabilities, axis=-2)
    per_group = num_experts * jnp.sum(fraction_routed * mean_probability, axis=-1)
    return jnp.mean(per_group)


def router_z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE z-loss: mean over tokens of ``logsumexp(logits)^2``; keeps logits small."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


class Router(nnx.Module):
    """A linear gate from the token's hidden state to one logit per expert."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        *,
        top_k: int,
        score_function: str = "softmax",
        normalize_top_k: bool = True,
        jitter: float = 0.0,
        rngs: nnx.Rngs,
    ):
        self.d_model = d_model
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_function = score_function
        self.normalize_top_k = normalize_top_k
        self.jitter = jitter
        init = nnx.initializers.variance_scaling(0.1, "fan_in", "truncated_normal")
        self.kernel = nnx.Param(init(rngs.params(), (d_model, num_experts), jnp.float32))

    def __call__(self, x: jax.Array, jitter_key: jax.Array | None = None) -> RouterOutput:
        chex.assert_shape(
            x, (None, None, self.d_model), custom_message="router input [groups, tokens, d_model]"
        )
        x = x.astype(jnp.float32)
        if self.jitter > 0 and jitter_key is not None:
            noise = jax.random.uniform(
                jitter_key, x.shape, jnp.float32, 1.0 - self.jitter, 1.0 + self.jitter
            )
            x = x * noise
        logits = x @ self.kernel[...]
        scores = router_scores(logits, self.score_function)
        weights, index = top_k_experts(logits, scores, self.top_k, self.normalize_top_k)
        return RouterOutput(
            expert_index=index,
            combine_weight=weights,
            aux_loss=load_balancing_loss(scores, index, self.num_experts),
            z_loss=router_z_loss(logits),
        )
