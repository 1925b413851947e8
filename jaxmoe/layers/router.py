"""Top-k routing: scores, expert choice, combine weights, and the router's losses.

Shapes: tokens come as ``[rows, tokens, d_model]`` (a routing group or a row per
leading index; the router treats every token alike). The router runs in float32
whatever the compute dtype: its softmax and the z-loss are sensitive to rounding.

The routing families (``moe.*`` fields in brackets):

- **softmax top-k** (GShard, Switch, Mixtral, Qwen-MoE): softmax over every expert,
  the ``top_k`` best, their scores as weights, renormalised over the top-k
  (``normalize_top_k``: Mixtral always, Qwen's ``norm_topk_prob``).
- **sigmoid** (DeepSeek-V3): an independent sigmoid per expert; the chosen scores,
  normalised over the top-k, times ``routed_scaling_factor`` (2.5 in DeepSeek-V3).
- **auxiliary-loss-free balancing** (DeepSeek-V3, ``expert_bias_rate``): a per-expert
  bias (:class:`ExpertBias`, HF's ``e_score_correction_bias``) is added to the scores
  for *choosing* experts only; the weights stay the unbiased scores. The train step
  moves it after each step from the step's load (:func:`update_expert_bias`).
- **group-limited routing** (DeepSeek-V3's ``n_group``/``topk_group``,
  ``num_expert_groups``/``top_k_expert_groups``): the experts form equal groups of
  consecutive indices; a group's score is the sum of its two best (biased) scores; only
  the ``top_k_expert_groups`` best groups are eligible for the token's top-k.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx


class ExpertBias(nnx.Variable):
    """The per-expert selection bias of auxiliary-loss-free balancing.

    Not a parameter: it gets no gradient, no weight decay and no optimizer state. The
    train state keeps it apart from the parameters (``TrainState.model_state``) and the
    step updates it from the routed load (:func:`update_expert_bias`)."""


class RouterOutput(NamedTuple):
    expert_index: jax.Array  # [rows, tokens, top_k] int32, best choice first
    combine_weight: jax.Array  # [rows, tokens, top_k] float32
    probabilities: jax.Array  # [rows, tokens, experts] float32: scores normalised per token
    z_loss: jax.Array  # scalar: router z-loss, mean over tokens


def router_scores(logits: jax.Array, score_function: str) -> jax.Array:
    """Per-expert scores: softmax over experts, or an independent sigmoid per expert."""
    if score_function == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits)
    raise ValueError(f"unknown score function {score_function!r}")


def select_experts(
    logits: jax.Array,
    scores: jax.Array,
    top_k: int,
    *,
    bias: jax.Array | None = None,
    num_groups: int = 1,
    top_k_groups: int | None = None,
) -> jax.Array:
    """``[..., top_k]`` int32: the experts each token is sent to, best first.

    Without a bias or expert groups, experts are ranked by their logits, which order
    them as the scores do (both score functions are monotone in the logit) without the
    scores' rounding: a float32 sigmoid is exactly 1.0 above a logit of about 17, so
    ranking by scores would tie such experts falsely and hand the token to the lowest
    index. With a bias or groups they are ranked by ``scores + bias`` (DeepSeek-V3's
    ``scores_for_choice``). Group-limited routing scores each of ``num_groups`` groups
    of consecutive experts by the sum of its two best ranking values, keeps the
    ``top_k_groups`` best groups, and chooses the top-k among their experts. True ties
    go to the lower index, of groups and of experts (``lax.top_k`` is stable).
    """
    chex.assert_equal_shape((logits, scores))
    grouped = num_groups > 1 and (top_k_groups or num_groups) < num_groups
    if bias is None and not grouped:
        key = logits
    else:
        key = scores if bias is None else scores + jax.lax.stop_gradient(bias)
    if grouped:
        num_experts = key.shape[-1]
        per_group = num_experts // num_groups
        by_group = key.reshape(*key.shape[:-1], num_groups, per_group)
        group_score = jnp.sum(jax.lax.top_k(by_group, min(2, per_group))[0], axis=-1)
        _, best_groups = jax.lax.top_k(group_score, top_k_groups)
        eligible = jnp.any(jax.nn.one_hot(best_groups, num_groups, dtype=bool), axis=-2)
        eligible = jnp.repeat(eligible, per_group, axis=-1)
        key = jnp.where(eligible, key, -jnp.inf)
    _, index = jax.lax.top_k(key, top_k)
    return index.astype(jnp.int32)


def combine_weights(
    scores: jax.Array, index: jax.Array, normalize: bool, scaling: float = 1.0
) -> jax.Array:
    """The chosen experts' (unbiased) scores; with ``normalize`` and ``top_k > 1``
    rescaled to sum to one (Mixtral, Qwen's ``norm_topk_prob``, DeepSeek-V3); then times
    ``scaling`` (DeepSeek-V3's ``routed_scaling_factor``). With ``top_k == 1`` the raw
    score is kept (Switch), so the task loss still trains the router."""
    weights = jnp.take_along_axis(scores, index, axis=-1)
    if normalize and index.shape[-1] > 1:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if scaling != 1.0:
        weights = weights * scaling
    return weights


def top_k_experts(
    logits: jax.Array, scores: jax.Array, top_k: int, normalize: bool
) -> tuple[jax.Array, jax.Array]:
    """The ``top_k`` best experts by logit and their combine weights (no bias, no groups)."""
    index = select_experts(logits, scores, top_k)
    return combine_weights(scores, index, normalize), index


def balance_loss(
    counts: jax.Array, probability_sum: jax.Array, tokens: int, top_k: int
) -> jax.Array:
    """``E * sum_e f_e * P_e`` per group: ``counts [..., E]`` the group's assignments to
    each expert (``f_e = counts_e / (top_k * tokens)``), ``probability_sum [..., E]`` the
    sum over the group's tokens of the normalised scores (``P_e = sum / tokens``).

    Linear in ``probability_sum``: given the whole group's counts, the partial sums of
    a group split over devices give partial losses that add up to the group's."""
    num_experts = counts.shape[-1]
    fraction = counts.astype(jnp.float32) / (top_k * tokens)
    return num_experts * jnp.sum(fraction * (probability_sum / tokens), axis=-1)


def load_balancing_loss(scores: jax.Array, expert_index: jax.Array, num_experts: int) -> jax.Array:
    """Switch/GShard auxiliary loss, ``num_experts * sum_e f_e * P_e``, averaged over groups.

    ``scores [groups, tokens, E]``, ``expert_index [groups, tokens, top_k]``. ``f_e`` is
    the fraction of the group's top-k assignments that chose expert ``e``; ``P_e`` the
    mean (normalised) score of expert ``e``. It is 1 when routing is uniform and grows
    as it concentrates. Over a sequence it is DeepSeek-V3's sequence-wise balance loss
    (``f_e = E / (K T) * count_e``).
    """
    probabilities = scores / jnp.sum(scores, axis=-1, keepdims=True)
    counts = jnp.sum(jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32), axis=(-3, -2))
    per_group = balance_loss(
        counts, jnp.sum(probabilities, axis=-2), expert_index.shape[-2], expert_index.shape[-1]
    )
    return jnp.mean(per_group)


def router_z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE z-loss: mean over tokens of ``logsumexp(logits)^2``; keeps logits small."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def update_expert_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free update: ``bias_e += rate * sign(mean - load_e)``.

    ``load [..., E]``: assignments routed to each expert in the step (before drops),
    over the whole batch. An overloaded expert's bias falls, an underloaded one's rises;
    an expert exactly at the mean keeps its bias."""
    load = load.astype(jnp.float32)
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - load)


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
        routed_scaling_factor: float = 1.0,
        num_expert_groups: int = 1,
        top_k_expert_groups: int | None = None,
        expert_bias: bool = False,
        jitter: float = 0.0,
        rngs: nnx.Rngs,
    ):
        self.d_model = d_model
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_function = score_function
        self.normalize_top_k = normalize_top_k
        self.routed_scaling_factor = routed_scaling_factor
        self.num_expert_groups = num_expert_groups
        self.top_k_expert_groups = top_k_expert_groups
        self.jitter = jitter
        init = nnx.initializers.variance_scaling(0.1, "fan_in", "truncated_normal")
        self.kernel = nnx.Param(init(rngs.params(), (d_model, num_experts), jnp.float32))
        self.expert_bias = (
            ExpertBias(jnp.zeros((num_experts,), jnp.float32)) if expert_bias else None
        )

    def __call__(self, x: jax.Array, jitter_key: jax.Array | None = None) -> RouterOutput:
        chex.assert_shape(
            x, (None, None, self.d_model), custom_message="router input [rows, tokens, d_model]"
        )
        x = x.astype(jnp.float32)
        if self.jitter > 0 and jitter_key is not None:
            noise = jax.random.uniform(
                jitter_key, x.shape, jnp.float32, 1.0 - self.jitter, 1.0 + self.jitter
            )
            x = x * noise
        logits = x @ self.kernel[...]
        scores = router_scores(logits, self.score_function)
        index = select_experts(
            logits,
            scores,
            self.top_k,
            bias=None if self.expert_bias is None else self.expert_bias[...],
            num_groups=self.num_expert_groups,
            top_k_groups=self.top_k_expert_groups,
        )
        return RouterOutput(
            expert_index=index,
            combine_weight=combine_weights(
                scores, index, self.normalize_top_k, self.routed_scaling_factor
            ),
            probabilities=scores / jnp.sum(scores, axis=-1, keepdims=True),
            z_loss=router_z_loss(logits),
        )
