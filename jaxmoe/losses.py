"""The loss of a batch of tokens on one device: cross-entropy and the routers' losses.

The cross-entropy is a sum over this device's counted targets divided by a
``denominator``: the targets of the whole step's batch on one device (on average over
the token shards), so that summing a device's microbatch losses gives its part of the
step's mean, and summing those over devices / token shards gives the global mean. Every
target counts, unless ``data.mask_across_documents`` drops those that cross into the
next packed document (the corpus's end-of-document id, ``eod_id``); attention and
positions then restart at each document (:mod:`jaxmoe.data.documents`).

The routers' losses (load balancing, the sequence-wise balance loss, the z-loss) are
means over a microbatch's groups and tokens, added per MoE layer (summed over layers, as
in Switch and Megatron) with their coefficients, weighted by ``1 / microbatches``.

With multi-token prediction (``model.mtp_depth`` D, :mod:`jaxmoe.layers.multi_token`),
module ``k`` adds the cross-entropy of the token ``k + 1`` places ahead over the targets
that exist (within the row, and with document masks within the position's document),
divided by the denominator times ``(S - k) / S`` for rows of ``S`` targets: a mean over
its targets (without document masks exactly; with them, the ``k`` positions before each
document's end that predict nothing are not taken out of the count). The total adds
``model.mtp_loss_weight`` times the modules' mean, which :attr:`Losses.ahead` reports.
The modules' MoE blocks add their routers' losses as the model's layers do.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxmoe.config import Config, MoEConfig
from jaxmoe.config.layout import PIPELINE as PIPELINE_AXIS
from jaxmoe.data.corpus import corpus_eod_id
from jaxmoe.data.documents import document_masks, loss_mask
from jaxmoe.layers import RoutingStats
from jaxmoe.parallel.collectives import manual_axes
from jaxmoe.parallel.sequence_split import sequence_slice


class Losses(NamedTuple):
    total: jax.Array  # what is differentiated (before the division by token shards)
    cross_entropy: jax.Array
    stats: RoutingStats
    # The multi-token prediction modules' cross-entropy, their mean (0 without them).
    ahead: jax.Array | float = 0.0


def document_eod_id(config: Config) -> int | None:
    """The end-of-document id the loss and attention stop at (``data.mask_across_documents``;
    the corpora's sidecars say it, the same for all), or None."""
    if not config.data.mask_across_documents:
        return None
    return corpus_eod_id(config.data.first_path)


def _counted(batch: jax.Array, eod_id: int | None) -> jax.Array:
    """This device's targets that count, as float32 ``[rows, its positions]``."""
    targets = batch[:, 1:]
    if eod_id is None:
        return jnp.ones(sequence_slice(targets).shape, jnp.float32)
    return sequence_slice(loss_mask(batch, eod_id)).astype(jnp.float32)


def targets_per_shard(config: Config, batch: jax.Array, eod_id: int | None) -> jax.Array:
    """The denominator of the step's cross-entropy: its counted targets on one device, on
    average over the token shards (every device's own count without document masks)."""
    targets = jnp.sum(_counted(batch, eod_id))
    # The pipeline's stages hold the same rows: they are not token shards.
    axes = manual_axes() - {PIPELINE_AXIS}
    if eod_id is None or not axes:
        return targets
    with jax.named_scope("metrics"):
        total = jax.lax.psum(targets, tuple(sorted(axes)))
    return total / config.parallel.token_shards


def cross_entropy(
    logits: jax.Array, batch: jax.Array, eod_id: int | None, denominator: jax.Array
) -> jax.Array:
    """This device's counted targets' cross-entropy (float32 ``logits`` of its positions
    of ``batch``'s rows), summed and divided by ``denominator``."""
    labels = sequence_slice(batch[:, 1:])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(losses * _counted(batch, eod_id)) / jnp.maximum(denominator, 1.0)


def router_losses(moe: MoEConfig, stats: RoutingStats) -> jax.Array:
    """The routers' losses of the MoE layers of ``stats`` (stacked over layers), summed
    over the layers with their coefficients."""
    return (
        moe.aux_loss_coef * jnp.sum(stats.aux_loss)
        + moe.seq_aux_loss_coef * jnp.sum(stats.seq_aux_loss)
        + moe.z_loss_coef * jnp.sum(stats.z_loss)
    )


def forward_losses(
    config: Config,
    graphdef: nnx.GraphDef,
    params: Any,
    batch: jax.Array,
    key: jax.Array | None,
    placement: jax.Array | None = None,
    model_state: Any = None,
    eod_id: int | None = None,
    denominator: jax.Array | None = None,
    microbatches: int = 1,
    block_call: Any = None,
) -> Losses:
    """The losses of this device's tokens of ``batch`` (its rows, and under tensor
    parallelism its slice of their positions); see the module docstring. ``denominator``:
    the step's (:func:`targets_per_shard`; default: this batch's own). ``block_call``: how
    the model calls its blocks (:class:`~jaxmoe.layers.GPTMoE`; default the plain call)."""
    model = nnx.merge(graphdef, params, *([] if model_state is None else [model_state]))
    tokens = batch[:, :-1]
    ahead_tokens = batch[:, 1:] if config.model.mtp_depth else None
    positions = segment_ids = None
    if eod_id is not None:
        masks = document_masks(batch, eod_id)
        positions, segment_ids = masks.positions, masks.segment_ids
    outputs = model.outputs(
        tokens, key, placement, positions, segment_ids, block_call, next_tokens=ahead_tokens
    )
    if denominator is None:
        denominator = targets_per_shard(config, batch, eod_id)
    entropy = cross_entropy(outputs.logits, batch, eod_id, denominator)
    routers = router_losses(config.moe, outputs.stats)
    total = entropy + routers / microbatches
    if not outputs.ahead:
        return Losses(total, entropy, outputs.stats)
    ahead = sum(
        ahead_cross_entropy(logits, batch, k, eod_id, denominator)
        for k, logits in enumerate(outputs.ahead, start=1)
    ) / len(outputs.ahead)
    total = total + config.model.mtp_loss_weight * ahead
    return Losses(total, entropy, outputs.stats, ahead)


def ahead_cross_entropy(
    logits: jax.Array, batch: jax.Array, k: int, eod_id: int | None, denominator: jax.Array
) -> jax.Array:
    """Multi-token prediction module ``k``'s cross-entropy (float32 ``logits`` of this
    device's positions): position ``i`` predicts token ``i + k + 1`` of the row, counted
    where it is in the row and, with ``eod_id``, where the targets ``i + 1 .. i + k + 1``
    all count (no document ends before it); over ``denominator`` scaled to the module's
    targets (module docstring)."""
    rows, length = batch.shape[0], batch.shape[1] - 1
    denominator = denominator * (length - k) / length
    labels = jnp.pad(batch[:, k + 1 :], ((0, 0), (0, k)))
    within = jnp.broadcast_to(jnp.arange(length) < length - k, (rows, length))
    counted = within.astype(jnp.float32)
    if eod_id is not None:
        mask = loss_mask(batch, eod_id).astype(jnp.float32)
        for shift in range(k + 1):
            counted = counted * jnp.pad(mask[:, shift:], ((0, 0), (0, shift)))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, sequence_slice(labels))
    return jnp.sum(losses * sequence_slice(counted)) / jnp.maximum(denominator, 1.0)
