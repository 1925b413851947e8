"""The training step, written per device: one ``shard_map`` over the whole mesh.

Inside it: the forward pass, the loss (:mod:`jaxmoe.losses`), ``jax.value_and_grad``
on each microbatch (:mod:`jaxmoe.pipeline.microbatches`) or, under ``parallel.pipeline``,
the pipeline's ticks over the microbatches (:mod:`jaxmoe.pipeline.pipelined`), the explicit
gradient synchronisation (``train.grad_sync``, :mod:`jaxmoe.parallel.grad_sync`),
global-norm clipping, the AdamW update, and (``moe.expert_bias_rate``) the routers'
expert biases moved from the step's global routed counts, outside the optimizer. Every
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

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from jaxmoe.config import Config
from jaxmoe.layers import RoutingStats
from jaxmoe.layers.router import update_expert_bias
from jaxmoe.losses import document_eod_id, forward_losses, targets_per_shard
from jaxmoe.parallel.fsdp import sharded_blocks
from jaxmoe.parallel.grad_sync import make_grad_sync
from jaxmoe.parallel.mesh import mesh_axis_sizes, token_spec
from jaxmoe.parallel.sharding import global_norm
from jaxmoe.parallel.zero import ZeroPlan, gather_all, gather_outside_blocks, sync_gradients
from jaxmoe.pipeline.microbatches import accumulate, combine_stats
from jaxmoe.pipeline.params import PIPELINE_AXIS
from jaxmoe.pipeline.pipelined import pipelined_gradients, pipelined_losses
from jaxmoe.placement.replicas import replicas_per_expert, slot_experts
from jaxmoe.train.optimizer import learning_rate_schedule, make_optimizer
from jaxmoe.train.state import (
    TrainState,
    model_graphdef_and_specs,
    param_state_specs,
    state_specs,
    zero_plan,
)

Metrics = dict[str, jax.Array]


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
    config: Config, stats: RoutingStats, axes: tuple[str, ...], shards: int
) -> Metrics:
    tokens_per_expert = jax.lax.psum(stats.tokens_per_expert, axes)  # [moe_layers, experts]
    per_layer_imbalance = jnp.max(tokens_per_expert, axis=-1) / jnp.mean(
        tokens_per_expert.astype(jnp.float32), axis=-1
    )
    losses = {"aux_loss": stats.aux_loss, "z_loss": stats.z_loss}
    if config.moe.seq_aux_loss_coef > 0:
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


def _model_params(plan: ZeroPlan | None, params: Any) -> tuple[Any, Any]:
    """What the forward pass reads for the state's ``params`` under ``train.zero``, and the
    context to trace it in: the parameters themselves (no ZeRO, or ZeRO-1's parameters
    already gathered); under ZeRO-3 those outside the blocks gathered and the blocks'
    shards, which each block gathers itself (:mod:`jaxmoe.parallel.fsdp`)."""
    if plan is None or plan.stage == 1:
        return params, contextlib.nullcontext()
    return gather_outside_blocks(params, plan), sharded_blocks(plan)


def _in_param_dtypes(grads: Any, params: Any) -> Any:
    """Gradients in their parameters' dtypes: ZeRO-1 gathers parameters in the compute
    dtype, but accumulates and reduces their gradients in the parameters' (float32)."""
    return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def build_train_step(config: Config, mesh: Mesh) -> ShardedStep:
    """``(state, batch [B, seq_len + 1]) -> (state, metrics)``, per device."""
    graphdef, _ = model_graphdef_and_specs(config)
    optimizer = make_optimizer(config.train)
    schedule = learning_rate_schedule(config.train)
    shards = config.parallel.token_shards
    axes = tuple(mesh.axis_names)
    clip_norm = config.train.grad_clip_norm
    # on_nonfinite=skip keeps the old parameters and optimizer state where a step's loss or
    # gradient norm is not finite; with 'stop' the loop ends the run and the step is as is.
    skip_nonfinite = config.train.on_nonfinite == "skip"
    bias_rate = config.moe.expert_bias_rate
    microbatches = config.train.microbatches
    eod_id = document_eod_id(config)
    grad_sync = make_grad_sync(config.train, mesh)
    mesh_axes = mesh_axis_sizes(config.parallel)
    plan = zero_plan(config)
    # The specs of what the optimizer updates: the parameters (under a pipeline, its
    # blocks stacked by stage), or under ZeRO their shards.
    update_specs = param_state_specs(config)
    pipelined = config.parallel.pipeline > 1
    # The stages of a pipeline read the same rows: the same router noise.
    key_axes = tuple(axis for axis in axes if axis != PIPELINE_AXIS)

    def per_device(state: TrainState, batch: jax.Array) -> tuple[TrainState, Metrics]:
        key = None
        if config.moe.jitter > 0:
            key = jax.random.fold_in(jax.random.key(config.train.seed), state.step)
            key = jax.random.fold_in(key, jax.lax.axis_index(key_axes))

        denominator = targets_per_shard(config, batch, eod_id)
        # ZeRO-1: every parameter gathered once, before the first microbatch (or the
        # pipeline's first tick); the gradients are those of the gathered parameters,
        # accumulated in the parameters' dtype and reduce-scattered after the last one.
        weights = gather_all(state.params, plan) if plan and plan.stage == 1 else state.params

        def microbatch(rows: jax.Array, index: int):
            mkey = key if key is None or microbatches == 1 else jax.random.fold_in(key, index)

            def loss_fn(params):
                params, context = _model_params(plan, params)
                with context:
                    losses = forward_losses(
                        config, graphdef, params, rows, mkey, state.placement, state.model_state,
                        eod_id, denominator, microbatches,
                    )  # fmt: skip
                return losses.total / shards, losses

            (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights)
            if plan is not None and plan.stage == 1:
                grads = _in_param_dtypes(grads, state.params)
            return losses, grads

        if pipelined:
            # The pipeline's ticks replace the microbatch loop (same losses, same sums).
            losses, grads = pipelined_gradients(
                config, weights, batch, key, state.placement, state.model_state, eod_id,
                denominator, accumulate_like=state.params,
            )  # fmt: skip
            total, cross_entropy, stats = losses
        else:
            parts, grads = accumulate(microbatch, batch, microbatches)
            total = sum(part.total for part in parts)
            cross_entropy = sum(part.cross_entropy for part in parts)
            stats = combine_stats([part.stats for part in parts])
        if plan is None:
            grads, sync_state, apply = grad_sync(grads, state.grad_sync, update_specs, mesh_axes)
        else:
            # Reduce-scattered onto the shards (config: allreduce or bucketed, stateless).
            grads = sync_gradients(
                grads, plan, config.train.grad_sync, config.train.grad_bucket_bytes
            )
            sync_state, apply = state.grad_sync, None
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
        if plan is None:
            params = grad_sync.after_update(params, state.step, update_specs, mesh_axes)

        with jax.named_scope("metrics"):
            metrics = {
                "loss": jax.lax.psum(cross_entropy / shards, axes),
                "total_loss": jax.lax.psum(total / shards, axes),
                "grad_norm": grad_norm,
                "learning_rate": schedule(state.step),
                **_routing_metrics(config, stats, axes, shards),
            }
            if state.placement is not None:
                metrics.update(_placement_metrics(stats, state.placement, axes))
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

    specs = state_specs(config)
    return ShardedStep(
        per_device=per_device,
        mesh=mesh,
        in_specs=(specs, token_spec(mesh)),
        out_specs=(specs, PartitionSpec()),
        donate_argnums=(0,),
        batch_argnums=(1,),
    )


def build_eval_step(config: Config, mesh: Mesh) -> ShardedStep:
    """``(params, batch, placement, model_state) -> mean cross-entropy`` over the global
    batch, per device.

    ``placement`` and ``model_state`` are the state's (None without replica slots, or
    without expert biases)."""
    graphdef, _ = model_graphdef_and_specs(config)
    shards = config.parallel.token_shards
    axes = tuple(mesh.axis_names)
    specs = state_specs(config)
    eod_id = document_eod_id(config)
    plan = zero_plan(config)

    def per_device(params: Any, batch: jax.Array, placement: Any, model_state: Any) -> jax.Array:
        if plan is not None and plan.stage == 1:
            params = gather_all(params, plan)
        if config.parallel.pipeline > 1:
            denominator = targets_per_shard(config, batch, eod_id)
            losses = pipelined_losses(
                config, params, batch, placement, model_state, eod_id, denominator
            )
            return jax.lax.psum(losses.cross_entropy / shards, axes)
        params, context = _model_params(plan, params)
        with context:
            losses = forward_losses(
                config, graphdef, params, batch, None, placement, model_state, eod_id
            )
        return jax.lax.psum(losses.cross_entropy / shards, axes)

    return ShardedStep(
        per_device=per_device,
        mesh=mesh,
        in_specs=(specs.params, token_spec(mesh), specs.placement, specs.model_state),
        out_specs=PartitionSpec(),
    )


def _update_expert_biases(model_state: Any, load: jax.Array, rate: float) -> Any:
    """Each MoE layer's expert bias moved by its row of ``load [moe_layers, experts]``.

    The biases are the leaves of ``model_state``, one per MoE layer; the layers are in
    depth order when sorted by the integer keys of their paths (the block indices)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model_state)
    if len(leaves) != load.shape[0]:
        raise ValueError(f"{len(leaves)} expert biases for {load.shape[0]} MoE layers")

    def depth(path: Any) -> tuple[int, ...]:
        keys = (getattr(entry, "key", getattr(entry, "idx", None)) for entry in path)
        return tuple(key for key in keys if isinstance(key, int))

    order = sorted(range(len(leaves)), key=lambda i: depth(leaves[i][0]))
    updated = [None] * len(leaves)
    for layer, i in enumerate(order):
        updated[i] = update_expert_bias(leaves[i][1], load[layer], rate)
    return jax.tree_util.tree_unflatten(treedef, updated)
