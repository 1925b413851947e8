"""The Mixture-of-Experts layer: route, dispatch, compute, combine.

Per device, a layer takes its local tokens ``[batch, seq, d]``, routes each to its top-k
experts (:mod:`jaxmoe.layers.router`), groups the choices into routing groups
(:mod:`jaxmoe.layers.routing_groups`: capacity is counted per group, and under context or
sequence parallelism a group of whole sequences is planned from choices gathered over the
sequence group), and hands them to its dispatcher (:mod:`jaxmoe.layers.dispatchers`), chosen once
from its configuration: the dispatcher plans which assignments each group keeps, sends the
tokens to the devices of their experts, runs the experts there, and brings each token's
combined output back. The losses that are means over a group (the load-balancing loss, the
sequence-wise one) are, for a group split over the sequence group, partial sums over each
device's positions, given the whole group's counts: summed over the sequence group they
are the group's loss.

Inside the whole-step ``shard_map`` (the expert axis is manual) the layer
calls the collectives directly. Called from global-view code under a mesh
(``jax.set_mesh``), it wraps itself in a ``shard_map`` over that mesh, each device
holding whole rows. With no mesh it runs on one device with every expert local and
no collective.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxmoe.config import MoEConfig
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.layers.dispatch import DispatchStats
from jaxmoe.layers.dispatchers import Dispatcher, choose_dispatcher
from jaxmoe.layers.experts import Experts
from jaxmoe.layers.router import Router, RouterOutput, balance_loss
from jaxmoe.layers.routing_groups import RoutingGroups, routing_groups
from jaxmoe.parallel.collectives import manual_axes
from jaxmoe.parallel.sequence_split import sequence_group_axes, sequence_group_size
from jaxmoe.parallel.sharding import param_specs


class RoutingStats(NamedTuple):
    """What one MoE layer reports about its routing, for the loss and for metrics."""

    # Load-balancing loss (mean over routing groups). Under sequence parallelism with
    # groups of whole sequences, this device's part: the sequence group's size x its
    # partial sums.
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
        fp8: str = "none",
        recompute: str = "none",
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        experimental: ExperimentalOptions = DEFAULT,
    ):
        """``activation``, ``bias`` and ``fp8``: the experts' form and GEMMs
        (``model.activation``, ``model.linear_bias``, ``model.fp8``;
        :mod:`jaxmoe.layers.experts`); ``recompute``: the block's recomputation
        (``model.recompute``), which decides what the activation keeps
        (:mod:`jaxmoe.layers.activations`). ``experimental``: research
        options of the dispatch (:mod:`jaxmoe.experimental`), kept for every configuration
        the layer is given."""
        self.experimental = experimental
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
            fp8=fp8,
            recompute=recompute,
            dtype=dtype,
            rngs=rngs,
        )

    @property
    def config(self) -> MoEConfig:
        """The layer's configuration. Setting it chooses the layer's dispatchers, once:
        ``dispatcher`` over the experts and ``replica_dispatcher`` over the slots of a
        replica table. A step has a table when ``moe.slots_per_device`` exceeds a device's
        own experts, which the mesh decides: the caller passes one or not, and that picks
        between the two."""
        return self._config

    @config.setter
    def config(self, config: MoEConfig) -> None:
        self._config = config
        experimental = self.experimental
        self.dispatcher: Dispatcher[Any, Any] = choose_dispatcher(config, False, experimental)
        self.replica_dispatcher: Dispatcher[Any, Any] = choose_dispatcher(
            config, True, experimental
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

        ``sequence_parallel``: inside the whole-step shard_map, the devices of a sequence
        group (context and tensor) hold the same rows, each its share of the positions
        (False: whole rows).
        ``replica_table`` (``[expert_axis, replica_slots]``, :mod:`jaxmoe.placement.replicas`)
        adds replica slots: assignments spread over every copy of their expert, and
        capacity is counted per slot.
        """
        chex.assert_shape(
            x, (None, None, self.router.d_model), custom_message="MoE input [batch, seq, d_model]"
        )
        config = self.config
        sequence = sequence_group_size() if sequence_parallel else 1
        dispatcher = self.dispatcher if replica_table is None else self.replica_dispatcher
        route = self.router(x, jitter_key)  # [batch, seq, ...]: this device's positions
        groups = routing_groups(route.expert_index, config.num_experts, config.group_size, sequence)
        plan = dispatcher.plan(route, groups, replica_table)
        sent = dispatcher.send(x, plan)
        outputs = dispatcher.run_experts(self.experts, sent)
        y = dispatcher.combine(outputs, sent).astype(x.dtype)
        stats = _routing_stats(route, groups, config, sequence, dispatcher.stats(groups, sent))
        return y.reshape(x.shape), stats

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


def _routing_stats(
    route: RouterOutput,
    groups: RoutingGroups,
    config: MoEConfig,
    sequence: int,
    dispatched: DispatchStats,
) -> RoutingStats:
    """This device's stats: the balance losses of its groups and rows (partial where they
    span the ``sequence`` group), its routed counts, and what the dispatch dropped."""
    num_experts, top_k = config.num_experts, config.top_k
    # With the sums of this device's probabilities, a partial loss when the group spans
    # the sequence group.
    probability_sum = jnp.sum(
        route.probabilities.reshape(groups.count, groups.local, num_experts), axis=1
    )
    losses = balance_loss(groups.counts, probability_sum, groups.size, top_k)
    aux_loss = groups.parts * jnp.mean(losses)
    if config.seq_aux_loss_coef > 0:
        row_counts = _counts(groups.choices.reshape(groups.rows, -1, top_k), num_experts, (1, 2))
        if groups.parts == 1 and sequence > 1:
            row_counts = jax.lax.psum(row_counts, sequence_group_axes())
        row_probability = jnp.sum(route.probabilities, axis=1)
        full_seq = route.expert_index.shape[1] * sequence
        seq_aux_loss = sequence * jnp.mean(
            balance_loss(row_counts, row_probability, full_seq, top_k)
        )
    else:
        seq_aux_loss = jnp.zeros((), jnp.float32)
    return RoutingStats(
        aux_loss=aux_loss,
        z_loss=route.z_loss,
        seq_aux_loss=seq_aux_loss,
        tokens_per_expert=_counts(route.expert_index, num_experts, axes=(0, 1, 2)),
        dropped=dispatched.dropped,
        assignments=jnp.asarray(route.expert_index.size, jnp.int32),
        slot_load=dispatched.slot_load,
        kept_by_copies=dispatched.kept_by_copies,
    )


def _counts(expert_index: jax.Array, num_experts: int, axes: tuple[int, ...]) -> jax.Array:
    """Assignments to each expert, summed over ``axes`` of ``expert_index``: int32."""
    return jnp.sum(jax.nn.one_hot(expert_index, num_experts, dtype=jnp.int32), axis=axes)
