"""The Mixture-of-Experts layer: route, dispatch, exchange, compute, return, combine.

Per device, a layer takes its local tokens ``[batch, seq, d]`` and:

1. routes each token to its top-k experts (:mod:`jaxmoe.layers.router`) and plans
   which assignments each routing group keeps (:mod:`jaxmoe.layers.dispatch`);
2. scatters them into per-expert capacity slots, ``[E, groups * C, d]``;
3. sends them to the devices holding their experts, which apply them, and
   brings each token's combined output back (``moe.dispatcher``,
   :mod:`jaxmoe.layers.dispatchers`: ``all_to_all`` over the expert group, or
   ``all_gather`` over the MoE group; either with each expert's hidden
   dimension split over the expert-tensor group). In dropless mode with
   ``moe.dropless_dispatch ragged`` steps 2-3 move and compute only the routed rows
   instead (:mod:`jaxmoe.layers.ragged`: sorted by expert, a ragged exchange, one
   grouped GEMM).

Routing groups (``moe.group_size``, capacity counted per group) are one whole sequence
by default, whatever the layout. Under tensor (sequence) parallelism a device holds
only ``seq_len / tensor`` positions of each row; a group of whole sequences is then
planned from the group's choices, all-gathered over the tensor group (``[rows,
seq_len / tensor, top_k]`` integers), identically on every member, and each device
dispatches the assignments of its own positions (:func:`~jaxmoe.layers.dispatch.local_plan`).
So ``parallel.tensor`` and ``parallel.expert_tensor`` never change which tokens are
dropped. A ``group_size`` that divides a device's slice of a sequence needs no gather.
The losses that are means over a group (the load-balancing loss, the sequence-wise
one) are then partial sums over each device's positions, given the whole group's
counts: summed over the tensor group they are the group's loss.

Inside the whole-step ``shard_map`` (the expert axis is manual) the layer
calls the collectives directly. Called from global-view code under a mesh
(``jax.set_mesh``), it wraps itself in a ``shard_map`` over that mesh, each device
holding whole rows. With no mesh it runs on one device with every expert local and
no collective.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxmoe.config import MoEConfig, capacity_per_expert
from jaxmoe.config.layout import EXPERT_TENSOR, TENSOR
from jaxmoe.layers.dispatch import (
    local_plan,
    plan_dispatch,
    plan_replicated_dispatch,
    replica_slots,
)
from jaxmoe.layers.dispatchers import all_gather_dispatch, all_to_all_dispatch
from jaxmoe.layers.experts import Experts
from jaxmoe.layers.ragged import ragged_dispatch
from jaxmoe.layers.router import Router, balance_loss
from jaxmoe.parallel.collectives import manual_axes
from jaxmoe.parallel.mesh import role_axes, role_size
from jaxmoe.parallel.sharding import param_specs
from jaxmoe.parallel.tensor_parallel import (
    sequence_shard_index,
    sequence_slice,
    tensor_group_size,
)
from jaxmoe.placement.copy_split import balanced_slots
from jaxmoe.placement.replicas import slot_experts


class RoutingStats(NamedTuple):
    """What one MoE layer reports about its routing, for the loss and for metrics."""

    # Load-balancing loss (mean over routing groups). Under sequence parallelism with
    # groups of whole sequences, this device's part: tensor x its partial sums.
    aux_loss: jax.Array
    z_loss: jax.Array  # router z-loss (mean over tokens)
    # DeepSeek-V3's sequence-wise balance loss (mean over rows), as aux_loss; 0 unless
    # moe.seq_aux_loss_coef > 0.
    seq_aux_loss: jax.Array
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
        seq_aux_loss=jax.lax.pmean(stats.seq_aux_loss, axes),
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
            routed_scaling_factor=config.routed_scaling_factor,
            num_expert_groups=config.num_expert_groups,
            top_k_expert_groups=config.top_k_expert_groups,
            expert_bias=config.expert_bias_rate > 0,
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
        *,
        sequence_parallel: bool = True,
    ) -> tuple[jax.Array, RoutingStats]:
        """The layer on this device's tokens ``[batch, seq, d]``; stats are local.

        ``sequence_parallel``: inside the whole-step shard_map, the devices of a tensor
        group hold the same rows, each its slice of the positions (False: whole rows).
        ``replica_table`` (``[expert_axis, replica_slots]``, :mod:`jaxmoe.placement.replicas`)
        adds replica slots: assignments spread over every copy of their expert, and
        capacity is counted per slot.
        """
        chex.assert_shape(
            x, (None, None, self.router.d_model), custom_message="MoE input [batch, seq, d_model]"
        )
        batch, seq, width = x.shape
        config = self.config
        num_experts, top_k = config.num_experts, config.top_k
        tensor = tensor_group_size() if sequence_parallel else 1
        full_seq = seq * tensor
        group_size = config.group_size or full_seq
        gathered = _spans_the_tensor_group(batch, seq, tensor, group_size)
        if replica_table is None:
            slot_expert, num_slots = None, num_experts
        else:
            slot_expert = slot_experts(replica_table, num_experts)
            num_slots = slot_expert.shape[0]
        capacity = capacity_per_expert(group_size, top_k, config.capacity_factor, num_slots)

        ragged = config.dropless and config.dropless_dispatch == "ragged"

        def plan(expert_index):
            if slot_expert is None:
                return plan_dispatch(expert_index, num_experts, capacity)
            return plan_replicated_dispatch(expert_index, slot_expert, num_experts, capacity)

        route = self.router(x, jitter_key)  # [batch, seq, ...]: this device's positions
        local_index = route.expert_index
        dispatch_plan = None
        if gathered:
            # Whole sequences: every member plans the group's assignments alike from
            # the gathered choices and keeps those of its own positions.
            full_index = jax.lax.all_gather(local_index, role_axes(TENSOR), axis=1, tiled=True)
            num_groups = batch * full_seq // group_size
            local_group = group_size // tensor
            group_index = full_index.reshape(num_groups, group_size, top_k)
            local_capacity = min(capacity, local_group)
            if not ragged:  # dropless ragged: nothing drops, each device sends its own
                group_plan = plan(group_index)

                def own(a):  # [G, group_size, k] -> this device's positions, [G, local_group, k]
                    a = sequence_slice(a.reshape(batch, full_seq, top_k))
                    return a.reshape(num_groups, local_group, top_k)

                slot_index = jnp.where(group_plan.kept, group_plan.slot // capacity, num_slots)
                dispatch_plan = local_plan(
                    own(slot_index), own(group_plan.kept), num_slots, local_capacity
                )
        else:
            if (batch * seq) % group_size:
                raise ValueError(
                    f"moe.group_size={group_size} does not divide the {batch * seq} tokens "
                    "on this device"
                )
            num_groups = batch * seq // group_size
            local_group = group_size
            group_index = local_index.reshape(num_groups, group_size, top_k)
            if not ragged:
                dispatch_plan = plan(group_index)
            local_capacity = capacity

        grouped = x.reshape(num_groups, local_group, width)
        weight = route.combine_weight.reshape(num_groups, local_group, top_k)
        if ragged:
            if role_size(EXPERT_TENSOR) > 1:
                raise ValueError(
                    "moe.dropless_dispatch=ragged needs whole experts on each device: set "
                    "parallel.expert_tensor 1, or moe.dropless_dispatch padded"
                )
            slot, slot_counts = local_index.reshape(-1, top_k), None
            if slot_expert is not None and config.replica_split == "balanced":
                slot, slot_counts = balanced_slots(slot, slot_expert, num_experts)
            elif slot_expert is not None:
                slot = replica_slots(slot[None], slot_expert, num_experts)[0]
            y, kept_rows = ragged_dispatch(
                self.experts,
                x.reshape(-1, width),
                slot,
                route.combine_weight.reshape(-1, top_k),
                num_slots,
                buffer_factor=config.ragged_buffer_factor,
                replica_table=replica_table,
                slot_counts=slot_counts,
            )
        elif slot_expert is not None:
            y = all_to_all_dispatch(
                self.experts,
                grouped,
                dispatch_plan,
                weight,
                num_slots,
                local_capacity,
                replica_table,
            )
        else:
            dispatcher = (
                all_gather_dispatch if config.dispatcher == "all_gather" else all_to_all_dispatch
            )
            y = dispatcher(
                self.experts, grouped, dispatch_plan, weight, num_experts, local_capacity
            )
        y = y.astype(x.dtype)

        # Routed counts of each whole group: [G, E]; with the sums of this device's
        # probabilities, a partial loss when the group spans the tensor group.
        group_counts = _counts(group_index, num_experts, axes=(1, 2))
        probability_sum = jnp.sum(
            route.probabilities.reshape(num_groups, local_group, num_experts), axis=1
        )
        parts = tensor if gathered else 1
        aux_loss = parts * jnp.mean(balance_loss(group_counts, probability_sum, group_size, top_k))
        if config.seq_aux_loss_coef > 0:
            if gathered:
                row_counts = _counts(full_index, num_experts, axes=(1, 2))
            else:
                row_counts = _counts(local_index, num_experts, axes=(1, 2))
                if tensor > 1:
                    row_counts = jax.lax.psum(row_counts, role_axes(TENSOR))
            row_probability = jnp.sum(route.probabilities, axis=1)
            seq_aux_loss = tensor * jnp.mean(
                balance_loss(row_counts, row_probability, full_seq, top_k)
            )
        else:
            seq_aux_loss = jnp.zeros((), jnp.float32)

        made = batch * seq * top_k  # this device's assignments
        stats = RoutingStats(
            aux_loss=aux_loss,
            z_loss=route.z_loss,
            seq_aux_loss=seq_aux_loss,
            tokens_per_expert=_counts(local_index, num_experts, axes=(0, 1, 2)),
            dropped=made - jnp.sum(kept_rows)
            if ragged
            else jnp.sum(~dispatch_plan.kept, dtype=jnp.int32),
            assignments=jnp.asarray(made, jnp.int32),
        )
        if slot_expert is not None:
            if ragged:
                slot_load = kept_rows
            else:
                kept_slot = jnp.where(
                    dispatch_plan.kept, dispatch_plan.slot // local_capacity, num_slots
                )
                slot_load = jnp.sum(
                    jax.nn.one_hot(kept_slot, num_slots, dtype=jnp.int32), (0, 1, 2)
                )
            places = capacity * jnp.arange(1, num_slots - num_experts + 2, dtype=jnp.int32)
            kept_by_copies = jnp.sum(jnp.minimum(group_counts[:, :, None], places), axis=0)
            if gathered:  # every member holds the whole groups' counts: count them once
                kept_by_copies = jnp.where(sequence_shard_index() == 0, kept_by_copies, 0)
            stats = stats._replace(slot_load=slot_load, kept_by_copies=kept_by_copies)
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
            y, stats = layer.per_device(x, key, sequence_parallel=False)
            return y, all_reduce_stats(stats, mesh_axes)

        mapped = jax.shard_map(
            body,
            in_specs=(specs, tokens, PartitionSpec()),
            out_specs=(tokens, PartitionSpec()),
        )
        # With Explicit mesh axes shard_map takes inputs only in the layout it declares.
        params = jax.reshard(nnx.to_pure_dict(state), specs)
        return mapped(params, jax.reshard(x, tokens), jitter_key)


def _counts(expert_index: jax.Array, num_experts: int, axes: tuple[int, ...]) -> jax.Array:
    """Assignments to each expert, summed over ``axes`` of ``expert_index``: int32."""
    return jnp.sum(jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32), axis=axes)


def _spans_the_tensor_group(batch: int, seq: int, tensor: int, group_size: int) -> bool:
    """Whether routing groups of ``group_size`` are whole sequences split over the tensor
    group (planned from gathered choices), rather than inside this device's tokens.

    ``seq``: the positions of each of the ``batch`` rows this device holds, its slice of
    ``seq * tensor``. Raises ValueError for a group size that is neither."""
    if tensor == 1 or seq % group_size == 0:
        return False
    full_seq = seq * tensor
    if group_size % full_seq == 0 and batch % (group_size // full_seq) == 0:
        return True
    raise ValueError(
        f"moe.group_size={group_size}: under tensor parallelism a routing group is a divisor "
        f"of the {seq} positions a device holds of each row, or whole sequences "
        f"(a multiple of {full_seq}) whose count divides the {batch} rows of a device"
    )
