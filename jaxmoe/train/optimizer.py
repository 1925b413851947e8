"""AdamW with linear warm-up and cosine decay.

Clipping is not part of the optax chain: the global norm of sharded gradients
needs collectives, so the train step computes it (``parallel.sharding.global_norm``)
and scales the gradients before the update.
"""

from __future__ import annotations

import jax
import optax

from jaxmoe.config import TrainConfig


def learning_rate_fn(train: TrainConfig) -> optax.Schedule:
    """Linear warm-up from peak / warmup_steps to the peak, then cosine decay to
    peak * min_lr_ratio at the last step (the first step already learns)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=train.learning_rate / max(1, train.warmup_steps),
        peak_value=train.learning_rate,
        warmup_steps=train.warmup_steps,
        # The schedule counts from 0; the last step run is steps - 1.
        decay_steps=max(train.steps - 1, train.warmup_steps + 1),
        end_value=train.learning_rate * train.min_lr_ratio,
    )


def _is_bias_or_scale(name: str) -> bool:
    return name in ("bias", "scale") or name.startswith("b_")


def _decay_mask(params):
    """Decay weight matrices (kernels, embeddings, expert weights); not biases or norm
    scales, which are known by name (``bias``, ``scale``, ``b_*``): an expert bias has a
    leading expert axis, so rank alone would not tell."""

    def decayed(path, leaf) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return leaf.ndim >= 2 and not _is_bias_or_scale(name)

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(
    train: TrainConfig, learning_rate: optax.Schedule
) -> optax.GradientTransformation:
    """AdamW for ``train`` at ``learning_rate`` (:func:`learning_rate_fn`)."""
    return optax.adamw(
        learning_rate,
        b1=train.adam_b1,
        b2=train.adam_b2,
        weight_decay=train.weight_decay,
        mask=_decay_mask,
    )
