"""Token dispatchers: how routed tokens reach their experts and come back, and which one a
layer uses.

A dispatcher is a strategy that the MoE layer chooses once, when it is built or given a
configuration (:func:`choose_dispatcher`), and then calls on every device's tokens:

- :class:`~jaxmoe.layers.padded.PaddedDispatch` (``moe.dispatcher all_to_all``, the
  default): ``capacity`` slots per expert, exchanged by ``all_to_all``;
- :class:`~jaxmoe.layers.all_gather.AllGatherDispatch` (``moe.dispatcher all_gather``): the
  same slots, filled from the MoE group's gathered tokens;
- :class:`~jaxmoe.layers.ragged.RaggedDispatch` (``moe.dropless_dispatch ragged``): only
  the routed rows move, one grouped GEMM;
- with a replica table, :class:`~jaxmoe.layers.replicated.ReplicatedDispatch` (padded) or
  :class:`~jaxmoe.layers.replicated.ReplicatedRaggedDispatch`: slots for the copies too,
  an expert's rows split over them balanced, or as the research options say
  (:class:`jaxmoe.experimental.ExperimentalOptions`).

Every capacity dispatcher plans the same slots (the rule of :mod:`jaxmoe.layers.dispatch`),
so ``moe.dispatcher`` never changes which assignments are kept and dropped; as
Megatron-Core's ``--moe-token-dispatcher-type``, it changes the bytes moved. all_gather
moves ``tokens x (group - 1) x d`` per device and direction, all_to_all ``tokens x top_k x
capacity_factor x d`` (times ``expert_tensor``): all_gather wins for small MoE groups
against ``top_k x capacity_factor x expert_tensor`` (e.g. a group of 2 with top-2
routing), and in dropless mode with many experts; all_to_all for large expert groups.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import jax

from jaxmoe.config import MoEConfig
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.layers.all_gather import AllGatherDispatch
from jaxmoe.layers.dispatch import DispatchStats
from jaxmoe.layers.experts import Experts
from jaxmoe.layers.padded import PaddedDispatch
from jaxmoe.layers.ragged import RaggedDispatch
from jaxmoe.layers.replicated import COPY_SPLITS, ReplicatedDispatch, ReplicatedRaggedDispatch
from jaxmoe.layers.router import RouterOutput
from jaxmoe.layers.routing_groups import RoutingGroups

Plan = TypeVar("Plan")  # each strategy's plan: where its assignments go
Sent = TypeVar("Sent")  # each strategy's tokens in flight: the experts' rows, the way back


class Dispatcher(Protocol[Plan, Sent]):
    """The steps of a dispatch, in the order the layer takes them."""

    def plan(
        self, route: RouterOutput, groups: RoutingGroups, replica_table: jax.Array | None
    ) -> Plan:
        """Where each of this device's assignments goes, and which drop."""
        ...

    def send(self, x: jax.Array, plan: Plan) -> Sent:
        """This device's tokens ``[rows, positions, d]`` to the devices of their experts."""
        ...

    def run_experts(self, experts: Experts, sent: Sent) -> jax.Array:
        """The local experts on the rows they received."""
        ...

    def combine(self, outputs: jax.Array, sent: Sent) -> jax.Array:
        """The outputs back to their tokens' devices, each token's summed by weight: its
        ``rows x positions`` tokens, in any shape."""
        ...

    def stats(self, groups: RoutingGroups, sent: Sent) -> DispatchStats:
        """What was dropped and, over replica slots, the slots' loads."""
        ...


def choose_dispatcher(
    config: MoEConfig, replicas: bool, experimental: ExperimentalOptions = DEFAULT
) -> Dispatcher[Any, Any]:
    """The dispatcher of ``config``; ``replicas``: over the slots of a replica table;
    ``experimental``: research options (the ragged dispatch's split over copies)."""
    if config.dropless and config.dropless_dispatch == "ragged":
        if replicas:
            return ReplicatedRaggedDispatch(
                config.num_experts,
                config.ragged_buffer_factor,
                split=COPY_SPLITS[experimental.replica_split],
            )
        return RaggedDispatch(config.num_experts, config.ragged_buffer_factor)
    if replicas:  # replica slots are exchanged by all_to_all (a configuration check)
        return ReplicatedDispatch(config.num_experts, config.capacity_factor)
    if config.dispatcher == "all_gather":
        return AllGatherDispatch(config.num_experts, config.capacity_factor)
    return PaddedDispatch(config.num_experts, config.capacity_factor)
