"""The training step, written per device: one ``shard_map`` over the whole mesh.

The step is composed from the strategies its :class:`~jaxmoe.train.resolved.Run` chose
once, in this order: how it reads the state's parameters (``Run.weights``: whole, or
gathered under ZeRO, :mod:`jaxmoe.parallel.weights`), how it differentiates its batch
(``jax.value_and_grad`` of the loss, :mod:`jaxmoe.losses`, on each microbatch,
:mod:`jaxmoe.pipeline.microbatches`, or under ``parallel.pipeline`` the pipeline's ticks over
the microbatches, :mod:`jaxmoe.pipeline.pipelined`), and how it synchronises the gradients
(``Run.grad_sync``: ``train.grad_sync``, :mod:`jaxmoe.parallel.grad_sync`, or its ZeRO
reduce-scatter); then global-norm clipping, the AdamW update, and
(``moe.expert_bias_rate``) the routers' expert biases moved from the step's global routed
counts, outside the optimizer. The evaluation step is composed from the same parts. Every
collective (the expert all-to-alls of forward and backward, the tensor-parallel
all-gathers and reduce-scatters and their transposes, the gradient psums) is
an equation of one per-device program, next to all of the computation — which
is what the scheduling layer rewrites.

Each device gets whole rows of the batch (replicated over its tensor group, and over
the stages of a pipeline, of which the last computes the loss) and computes the loss on
its own tokens: its slice of the positions under tensor (sequence) parallelism, all of
them otherwise.

``check_vma=False``: the step reduces gradients itself. Each device
differentiates its own loss divided by the number of token shards, so summing
a gradient over the axes its parameter is replicated on gives exactly the
gradient of the global mean loss (expert gradients arrive already summed over
the expert group through the backward all-to-all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from jaxmoe.layers import RoutingStats
from jaxmoe.layers.router import update_expert_bias
from jaxmoe.losses import Losses, document_eod_id, forward_losses, targets_per_shard
from jaxmoe.parallel.mesh import token_spec
from jaxmoe.parallel.sharding import global_norm
from jaxmoe.pipeline.microbatches import accumulate, combine_stats
from jaxmoe.pipeline.params import PIPELINE_AXIS
from jaxmoe.pipeline.pipelined import pipelined_gradients, pipelined_losses
from jaxmoe.placement.replicas import replicas_per_expert, slot_experts
from jaxmoe.train.resolved import Run
from jaxmoe.train.state import TrainState

Metrics = dict[str, jax.Array]
PyTree = Any
# ``(weights, batch, key, placement, model_state, denominator) -> (losses, gradients)``:
# this device's losses over its rows and the gradients of ``weights``, unsynchronised.
Gradients = Callable[..., tuple[Losses, PyTree]]
# ``(weights, batch, placement, model_state, denominator) -> losses``: the forward alone.
ForwardLosses = Callable[..., Losses]


@dataclass(frozen=True)
class ShardedStep:
    """A per-device function and how its arguments and results lie on the mesh."""

    per_device: Callable[..., Any]
    mesh: Mesh
    in_specs: tuple[Any, ...]
    out_specs: Any
    donate_argnums: tuple[int, ...] = ()
    batch_argnums: tuple[int, ...] = ()  # arguments whose leading axis is the batch

    def jit(self) -> Callable[..., Any]:
        mapped = jax.shard_map(
            self.per_device,
            mesh=self.mesh,
            in_specs=self.in_specs,
            out_specs=self.out_specs,
            check_vma=False,
        )
        return jax.jit(mapped, donate_argnums=self.donate_argnums)


def _placement_metrics(stats: RoutingStats, placement: jax.Array, axes: tuple[str, ...]) -> Metrics:
    """Per MoE layer: assignments kept by each expert-axis device's slots (summed over the
    data axis), assignments kept per expert, and the copies of each expert."""
    moe_layers, expert_axis, _ = placement.shape
    num_experts = stats.tokens_per_expert.shape[-1]
    slot_load = jax.lax.psum(stats.slot_load, axes)  # [moe_layers, expert_axis * slots]
    holds = jax.nn.one_hot(
        jax.vmap(slot_experts, in_axes=(0, None))(placement, num_experts), num_experts
    )
    return {
        "device_load": jnp.sum(slot_load.reshape(moe_layers, expert_axis, -1), axis=-1),
        "kept_per_expert": jnp.einsum("ls,lse->le", slot_load, holds.astype(slot_load.dtype)),
        "replicas_per_expert": replicas_per_expert(placement, num_experts),
        "kept_by_copies": jax.lax.psum(stats.kept_by_copies, axes),
    }


def _routing_metrics(
    seq_aux_loss: bool, stats: RoutingStats, axes: tuple[str, ...], shards: int
) -> Metrics:
    tokens_per_expert = jax.lax.psum(stats.tokens_per_expert, axes)  # [moe_layers, experts]
    per_layer_imbalance = jnp.max(tokens_per_expert, axis=-1) / jnp.mean(
        tokens_per_expert.astype(jnp.float32), axis=-1
    )
    losses = {"aux_loss": stats.aux_loss, "z_loss": stats.z_loss}
    if seq_aux_loss:
        losses["seq_aux_loss"] = stats.seq_aux_loss
    return {
        # Means over MoE layers of the global means.
        **{name: jax.lax.psum(jnp.mean(value) / shards, axes) for name, value in losses.items()},
        "dropped_fraction": jax.lax.psum(jnp.sum(stats.dropped), axes)
        / jax.lax.psum(jnp.sum(stats.assignments), axes),
        "tokens_per_expert": tokens_per_expert,
        # The worst MoE layer's max/mean load.
        "expert_imbalance": jnp.max(per_layer_imbalance),
    }


def _microbatch_gradients(run: Run, eod_id: int | None) -> Gradients:
    """The microbatch loop: ``jax.value_and_grad`` of each microbatch's loss in turn, the
    gradients summed (in the parameters' dtypes, :meth:`Weights.gradients`)."""
    config, weights_of = run.config, run.weights
    microbatches, shards = config.train.microbatches, config.parallel.token_shards

    def gradients(weights, batch, key, placement, model_state, denominator, params):
        def microbatch(weights, rows: jax.Array, index: int):
            mkey = key if key is None or microbatches == 1 else jax.random.fold_in(key, index)

            def loss_fn(weights):
                model_params, block_call = weights_of.for_forward(weights)
                losses = forward_losses(
                    config, run.graphdef, model_params, rows, mkey, placement, model_state,
                    eod_id, denominator, microbatches, block_call=block_call,
                )  # fmt: skip
                return losses.total / shards, losses

            (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights)
            return losses, weights_of.gradients(grads, params)

        parts, grads = accumulate(microbatch, weights, batch, microbatches)
        losses = Losses(
            sum(part.total for part in parts),
            sum(part.cross_entropy for part in parts),
            combine_stats([part.stats for part in parts]),
            sum(part.ahead for part in parts),
        )
        return losses, grads

    return gradients


def _pipeline_gradients(run: Run, eod_id: int | None) -> Gradients:
    """The pipeline's ticks over the microbatches (same losses, same sums as the loop)."""

    def gradients(weights, batch, key, placement, model_state, denominator, params):
        return pipelined_gradients(
            run.config, run.pipeline, weights, batch, key, placement, model_state, eod_id,
            denominator, accumulate_like=params,
        )  # fmt: skip

    return gradients


def _forward_losses(run: Run, eod_id: int | None) -> ForwardLosses:
    """The evaluation's forward pass over a batch: the model's, or the pipeline's forward
    slots."""
    config = run.config
    if run.pipeline is not None:

        def pipelined(weights, batch, placement, model_state, denominator):
            return pipelined_losses(
                config, run.pipeline, weights, batch, placement, model_state, eod_id,
                denominator,
            )  # fmt: skip

        return pipelined

    def whole(weights, batch, placement, model_state, denominator):
        model_params, block_call = run.weights.for_forward(weights)
        return forward_losses(
            config, run.graphdef, model_params, batch, None, placement, model_state, eod_id,
            denominator, block_call=block_call,
        )  # fmt: skip

    return whole


def build_train_step(run: Run) -> ShardedStep:
    """``(state, batch [B, seq_len + 1]) -> (state, metrics)``, per device, on the run's
    mesh."""
    config, mesh = run.config, run.on_mesh
    optimizer, grad_sync, weights_of = run.optimizer, run.grad_sync, run.weights
    shards = config.parallel.token_shards
    axes = tuple(mesh.axis_names)
    clip_norm = config.train.grad_clip_norm
    # on_nonfinite=skip keeps the old parameters and optimizer state where a step's loss or
    # gradient norm is not finite; with 'stop' the loop ends the run and the step is as is.
    skip_nonfinite = config.train.on_nonfinite == "skip"
    bias_rate = config.moe.expert_bias_rate
    seq_aux_loss = config.moe.seq_aux_loss_coef > 0
    eod_id = document_eod_id(config)
    gradients = (
        _microbatch_gradients(run, eod_id)
        if run.pipeline is None
        else _pipeline_gradients(run, eod_id)
    )
    # The specs of what the optimizer updates: the parameters (under a pipeline, its
    # blocks stacked by stage), or under ZeRO their shards.
    update_specs = run.param_specs
    # The stages of a pipeline read the same rows: the same router noise.
    key_axes = tuple(axis for axis in axes if axis != PIPELINE_AXIS)

    def per_device(state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        key = None
        if config.moe.jitter > 0:
            key = jax.random.fold_in(jax.random.key(config.train.seed), state.step)
            key = jax.random.fold_in(key, jax.lax.axis_index(key_axes))

        denominator = targets_per_shard(config, batch, eod_id)
        weights = weights_of.for_step(state.params)
        losses, grads = gradients(
            weights, batch, key, state.placement, state.model_state, denominator, state.params
        )
        grads, sync_state, apply = grad_sync(grads, state.grad_sync, update_specs, run.axis_sizes)
        with jax.named_scope("clip"):
            grad_norm = global_norm(grads, update_specs)
        if clip_norm is not None:
            scale = jnp.minimum(1.0, clip_norm / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if apply is not None:
            # The algorithm has nothing to apply this step (delayed, step 0).
            params, opt_state = jax.tree.map(
                lambda new, old: jnp.where(apply, new, old),
                (params, opt_state),
                (state.params, state.opt_state),
            )
        params = grad_sync.after_update(params, state.step, update_specs, run.axis_sizes)

        with jax.named_scope("metrics"):
            metrics = {
                "loss": jax.lax.psum(losses.cross_entropy / shards, axes),
                "total_loss": jax.lax.psum(losses.total / shards, axes),
                "grad_norm": grad_norm,
                "learning_rate": run.learning_rate(state.step),
                **_routing_metrics(seq_aux_loss, losses.stats, axes, shards),
            }
            if config.model.mtp_depth:
                metrics["mtp_loss"] = jax.lax.psum(losses.ahead / shards, axes)
            if state.placement is not None:
                metrics.update(_placement_metrics(losses.stats, state.placement, axes))
        model_state = state.model_state
        if model_state is not None:
            # Auxiliary-loss-free balancing, outside the optimizer: from the step's global
            # routed counts (the same psum on every device, so the same bias everywhere).
            with jax.named_scope("expert_bias"):
                model_state = _update_expert_biases(
                    model_state, metrics["tokens_per_expert"], bias_rate
                )
        if skip_nonfinite:
            # Both are global values, so every device takes the same decision.
            finite = jnp.isfinite(metrics["total_loss"]) & jnp.isfinite(grad_norm)
            # The sync state too: a non-finite residual would poison every later step.
            params, opt_state, sync_state, model_state = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old),
                (params, opt_state, sync_state, model_state),
                (state.params, state.opt_state, state.grad_sync, state.model_state),
            )
            metrics["skipped"] = jnp.logical_not(finite).astype(jnp.int32)
        new_state = TrainState(
            state.step + 1, params, opt_state, sync_state, state.placement, model_state
        )
        return new_state, metrics

    specs = run.specs
    return ShardedStep(
        per_device=per_device,
        mesh=mesh,
        in_specs=(specs, token_spec(mesh)),
        out_specs=(specs, PartitionSpec()),
        donate_argnums=(0,),
        batch_argnums=(1,),
    )


def build_eval_step(run: Run) -> ShardedStep:
    """``(params, batch, placement, model_state) -> mean cross-entropy`` over the global
    batch, per device, composed from the train step's parts.

    ``placement`` and ``model_state`` are the state's (None without replica slots, or
    without expert biases)."""
    config, mesh = run.config, run.on_mesh
    shards = config.parallel.token_shards
    axes = tuple(mesh.axis_names)
    eod_id = document_eod_id(config)
    weights_of = run.weights
    losses_of = _forward_losses(run, eod_id)

    def per_device(params: Any, batch: jax.Array, placement: Any, model_state: Any) -> jax.Array:
        denominator = targets_per_shard(config, batch, eod_id)
        losses = losses_of(weights_of.for_step(params), batch, placement, model_state, denominator)
        return jax.lax.psum(losses.cross_entropy / shards, axes)

    specs = run.specs
    return ShardedStep(
        per_device=per_device,
        mesh=mesh,
        in_specs=(specs.params, token_spec(mesh), specs.placement, specs.model_state),
        out_specs=PartitionSpec(),
    )


def _update_expert_biases(model_state: Any, load: jax.Array, rate: float) -> Any:
    """Each MoE layer's expert bias moved by its row of ``load [moe_layers, experts]``.

    The biases are the leaves of ``model_state``, one per MoE layer; the layers are in
    depth order when sorted by the integer keys of their paths (the block indices), the
    multi-token prediction modules' (under ``mtp``) after the model's."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model_state)
    if len(leaves) != load.shape[0]:
        raise ValueError(f"{len(leaves)} expert biases for {load.shape[0]} MoE layers")

    def depth(path: Any) -> tuple[int, ...]:
        keys = [getattr(entry, "key", getattr(entry, "idx", None)) for entry in path]
        return (int("mtp" in keys), *(key for key in keys if isinstance(key, int)))

    order = sorted(range(len(leaves)), key=lambda i: depth(leaves[i][0]))
    updated = [None] * len(leaves)
    for layer, i in enumerate(order):
        updated[i] = update_expert_bias(leaves[i][1], load[layer], rate)
    return jax.tree_util.tree_unflatten(treedef, updated)
