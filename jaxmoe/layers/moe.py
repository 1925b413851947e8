"""The Mixture-of-Experts layer: route, dispatch, exchange, compute, return, combine.

Per device, a layer takes its local tokens ``[batch, seq, d]`` and:

1. groups them into routing groups and routes each token to its top-k experts;
2. scatters them into per-expert capacity slots, ``[E, groups * C, d]``;
3. sends them to the devices holding their experts, which apply them, and
   brings each token's combined output back (``moe.dispatcher``,
   :mod:`jaxmoe.layers.dispatchers`: ``all_to_all`` over the expert group, or
   ``all_gather`` over the MoE group; either with each expert's hidden
   dimension split over the expert-tensor group).

Inside the whole-step ``shard_map`` (the expert axis is manual) the layer
calls the collectives directly. Called from global-view code under a mesh
(``jax.set_mesh``), it wraps itself in a ``shard_map`` over that mesh. With
no mesh it runs on one device with every expert local and no collective.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxmoe.config import MoEConfig, capacity_per_expert
from jaxmoe.layers.dispatch import plan_dispatch, plan_replicated_dispatch
from jaxmoe.layers.dispatchers import all_gather_dispatch, all_to_all_dispatch
from jaxmoe.layers.experts import Experts
from jaxmoe.layers.router import Router
from jaxmoe.parallel.collectives import manual_axes
from jaxmoe.parallel.placement import slot_experts
from jaxmoe.parallel.sharding import param_specs


class RoutingStats(NamedTuple):
    """What one MoE layer reports about its routing, for the loss and for metrics."""

    aux_loss: jax.Array  # load-balancing loss (mean over routing groups)
    z_loss: jax.Array  # router z-loss (mean over tokens)
    tokens_per_expert: jax.Array  # [num_experts] assignments routed to each expert, pre-drop
    dropped: jax.Array  # assignments dropped for lack of capacity
    assignments: jax.Array  # assignments made (tokens * top_k)
    # With a replica table: [expert_axis * slots_per_device] assignments kept per slot.
    slot_load: jax.Array | None = None
    # With a replica table: [num_experts, max_copies] assignments each expert would keep with
    # 1, 2, ... copies (sum over groups of min(routed, copies * capacity)), for the planner.
    kept_by_copies: jax.Array | None = None


def all_reduce_stats(stats: RoutingStats, axes: tuple[str, ...]) -> RoutingStats:
    """Combine per-device stats over ``axes``: losses averaged, counts summed."""
    return RoutingStats(
        aux_loss=jax.lax.pmean(stats.aux_loss, axes),
        z_loss=jax.lax.pmean(stats.z_loss, axes),
        tokens_per_expert=jax.lax.psum(stats.tokens_per_expert, axes),
        dropped=jax.lax.psum(stats.dropped, axes),
        assignments=jax.lax.psum(stats.assignments, axes),
        slot_load=None if stats.slot_load is None else jax.lax.psum(stats.slot_load, axes),
        kept_by_copies=None
        if stats.kept_by_copies is None
        else jax.lax.psum(stats.kept_by_copies, axes),
    )


class MoELayer(nnx.Module):
    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        config: MoEConfig,
        *,
        activation: str = "gelu",
        bias: bool = True,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        """``activation`` and ``bias``: the experts' form (``model.activation``,
        ``model.linear_bias``; :mod:`jaxmoe.layers.experts`)."""
        self.config = config
        self.router = Router(
            d_model,
            config.num_experts,
            top_k=config.top_k,
            score_function=config.score_function,
            normalize_top_k=config.normalize_top_k,
            jitter=config.jitter,
            rngs=rngs,
        )
        self.experts = Experts(
            config.num_experts,
            d_model,
            config.d_expert or d_hidden,
            activation=activation,
            bias=bias,
            dtype=dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        x: jax.Array,
        jitter_key: jax.Array | None = None,
        replica_table: jax.Array | None = None,
    ) -> tuple[jax.Array, RoutingStats]:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or manual_axes():
            return self.per_device(x, jitter_key, replica_table)
        if replica_table is not None:
            raise ValueError("a replica table needs the whole-step shard_map (or no mesh)")
        return self._shard_mapped(x, jitter_key, tuple(mesh.axis_names))

    def per_device(
        self,
        x: jax.Array,
        jitter_key: jax.Array | None = None,
        replica_table: jax.Array | None = None,
    ) -> tuple[jax.Array, RoutingStats]:
        """The layer on this device's tokens ``[batch, seq, d]``; stats are local.

        ``replica_table`` (``[expert_axis, replica_slots]``, :mod:`jaxmoe.parallel.placement`)
        adds replica slots: assignments spread over every copy of their expert, and
        capacity is counted per slot.
        """
        if replica_table is not None:
            return self._replicated(x, jitter_key, replica_table)
        chex.assert_shape(
            x, (None, None, self.router.d_model), custom_message="MoE input [batch, seq, d_model]"
        )
        batch, seq, width = x.shape
        group_size = self.config.group_size or seq
        tokens = batch * seq
        if tokens % group_size:
            raise ValueError(
                f"moe.group_size={group_size} does not divide the {tokens} tokens on this device"
            )
        num_groups = tokens // group_size
        num_experts = self.config.num_experts
        capacity = capacity_per_expert(
            group_size, self.config.top_k, self.config.capacity_factor, num_experts
        )

        grouped = x.reshape(num_groups, group_size, width)
        route = self.router(grouped, jitter_key)
        plan = plan_dispatch(route.expert_index, num_experts, capacity)
        dispatcher = (
            all_gather_dispatch if self.config.dispatcher == "all_gather" else all_to_all_dispatch
        )
        y = dispatcher(self.experts, grouped, plan, route.combine_weight, num_experts, capacity)
        y = y.astype(x.dtype)

        stats = RoutingStats(
            aux_loss=route.aux_loss,
            z_loss=route.z_loss,
            tokens_per_expert=jnp.sum(
                jax.nn.one_hot(route.expert_index, num_experts, dtype=jnp.int32), axis=(0, 1, 2)
            ),
            dropped=jnp.sum(~plan.kept, dtype=jnp.int32),
            assignments=jnp.asarray(plan.kept.size, jnp.int32),
        )
        return y.reshape(batch, seq, width), stats

    def _replicated(
        self, x: jax.Array, jitter_key: jax.Array | None, replica_table: jax.Array
    ) -> tuple[jax.Array, RoutingStats]:
        batch, seq, width = x.shape
        group_size = self.config.group_size or seq
        num_groups = batch * seq // group_size
        num_experts = self.config.num_experts
        slot_expert = slot_experts(replica_table, num_experts)
        num_slots = slot_expert.shape[0]
        capacity = capacity_per_expert(
            group_size, self.config.top_k, self.config.capacity_factor, num_slots
        )

        grouped = x.reshape(num_groups, group_size, width)
        route = self.router(grouped, jitter_key)
        plan = plan_replicated_dispatch(route.expert_index, slot_expert, num_experts, capacity)
        y = all_to_all_dispatch(
            self.experts, grouped, plan, route.combine_weight, num_slots, capacity, replica_table
        ).astype(x.dtype)
        kept_slot = jnp.where(plan.kept, plan.slot // capacity, num_slots)
        routed = jnp.sum(
            jax.nn.one_hot(route.expert_index, num_experts, dtype=jnp.int32), axis=(1, 2)
        )  # [G, E]
        places = capacity * jnp.arange(1, num_slots - num_experts + 2, dtype=jnp.int32)
        stats = RoutingStats(
            aux_loss=route.aux_loss,
            z_loss=route.z_loss,
            tokens_per_expert=jnp.sum(routed, axis=0),
            dropped=jnp.sum(~plan.kept, dtype=jnp.int32),
            assignments=jnp.asarray(plan.kept.size, jnp.int32),
            slot_load=jnp.sum(jax.nn.one_hot(kept_slot, num_slots, dtype=jnp.int32), (0, 1, 2)),
            kept_by_copies=jnp.sum(jnp.minimum(routed[:, :, None], places), axis=0),
        )
        return y.reshape(batch, seq, width), stats

    def _shard_mapped(
        self, x: jax.Array, jitter_key: jax.Array | None, mesh_axes: tuple[str, ...]
    ) -> tuple[jax.Array, RoutingStats]:
        """Global-view call: shard tokens over every mesh axis, experts over ``expert``."""
        graphdef, state = nnx.split(self)
        specs = param_specs(state)
        tokens = PartitionSpec(mesh_axes)

        def body(params, x, key):
            layer = nnx.merge(graphdef, params)
            if key is not None:
                key = jax.random.fold_in(key, jax.lax.axis_index(mesh_axes))
            y, stats = layer.per_device(x, key)
            return y, all_reduce_stats(stats, mesh_axes)

        mapped = jax.shard_map(
            body,
            in_specs=(specs, tokens, PartitionSpec()),
            out_specs=(tokens, PartitionSpec()),
        )
        # With Explicit mesh axes shard_map takes inputs only in the layout it declares.
        params = jax.reshard(nnx.to_pure_dict(state), specs)
        return mapped(params, jax.reshard(x, tokens), jitter_key)
