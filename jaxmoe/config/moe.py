"""The MoE section: routing, capacity, experts, dispatch and expert placement."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from jaxmoe.config import choices
from jaxmoe.config.checks import (
    ConfigError,
    check_types,
    non_negative,
    one_of,
    positive_int,
    require,
)
from jaxmoe.config.model import ModelConfig

# How dropless routing (capacity_factor None) moves and computes its tokens
# (jaxmoe/layers/ragged.py): padded per-expert buffers of group_size slots, or only the
# routed rows, sorted by expert, exchanged ragged and computed as one grouped GEMM.
DROPLESS_DISPATCHES = ("padded", "ragged")

# Research options that left the section (jaxmoe.experimental), and the hint for each.
EXPERIMENTAL_FIELDS = {
    "replica_split": (
        "experimental, no longer a setting: remove it (the ragged dispatch always splits an "
        "expert's rows balanced); experiments pass "
        "jaxmoe.experimental.ExperimentalOptions(replica_split=...) to resolve"
    ),
}
# A saved section's research options at these values were the library's behaviour: dropped.
_DROPPED_DEFAULTS: dict[str, Any] = {"replica_split": "balanced"}


@dataclass(frozen=True)
class MoEConfig:
    """Routing and expert settings shared by every MoE layer."""

    # Routed experts per MoE layer (a multiple of parallel.expert).
    num_experts: int = 8
    # Experts each token is routed to.
    top_k: int = 1
    # Capacity per expert = ceil(group_size * top_k * capacity_factor / num_experts).
    # None selects dropless dispatch (no token is ever dropped).
    capacity_factor: float | None = 1.0
    # Tokens per routing group; capacity is counted per group (GShard). None = one whole
    # sequence (model.seq_len tokens), whatever the layout: under tensor parallelism the
    # group is planned from choices gathered over the tensor group, so no parallel layout
    # changes which tokens are dropped. Else a divisor of the tokens a device holds; under
    # tensor parallelism a divisor of its seq_len / tensor positions of a row, or a multiple
    # of seq_len whose rows divide a device's.
    group_size: int | None = None
    # softmax (GShard, Switch, Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3).
    score_function: str = "softmax"
    # Renormalise the top-k weights to sum to one (Mixtral; Qwen's and DeepSeek-V3's
    # norm_topk_prob). Ignored for top_k == 1, where it would make every weight 1 and cut
    # the router off from the task loss.
    normalize_top_k: bool = True
    # The routed experts' weights are multiplied by this (DeepSeek-V3: 2.5).
    routed_scaling_factor: float = 1.0
    # Group-limited routing (DeepSeek-V3's n_group, topk_group): the experts form this many
    # groups of consecutive indices, each scored by the sum of its two best (biased)
    # scores; a token's experts are chosen among the top_k_expert_groups best groups only.
    num_expert_groups: int = 1
    # Group-limited routing: the groups a token's experts are chosen from (None: every
    # group).
    top_k_expert_groups: int | None = None
    # Auxiliary-loss-free balancing (DeepSeek-V3; 0 = off, DeepSeek uses 0.001): a
    # per-expert bias added to the scores for choosing experts (not to their weights),
    # moved after every step by this rate towards balance: bias_e += rate *
    # sign(mean load - load_e) over the step's routed assignments. Part of the train state
    # (not a parameter: no gradient, no optimizer).
    expert_bias_rate: float = 0.0
    # Weight of the load-balancing loss (Switch, GShard: num_experts x sum over experts of
    # the fraction of assignments times the mean score, per routing group) in the loss.
    aux_loss_coef: float = 1e-2
    # DeepSeek-V3's complementary sequence-wise balance loss: the load-balancing loss over
    # each sequence (row), averaged over rows. With the default routing group (one
    # sequence) it equals the aux loss above.
    seq_aux_loss_coef: float = 0.0
    # Weight of the router z-loss (ST-MoE: the mean over tokens of logsumexp(logits)^2).
    z_loss_coef: float = 1e-3
    # Multiplicative input noise U(1 - jitter, 1 + jitter) on the router during training.
    jitter: float = 0.0
    # Hidden width of each expert; None = model.d_ff.
    d_expert: int | None = None
    # Shared experts: always-on experts beside the routed ones, applied to every token and
    # added to the routed output (DeepSeek, Qwen-MoE). Their total hidden width is
    # num_shared_experts x d_shared_expert, computed as one FFN replicated like the dense
    # layers'.
    num_shared_experts: int = 0
    # Hidden width of each shared expert; None: moe.d_expert, else model.d_ff.
    d_shared_expert: int | None = None
    # Qwen-MoE's gate on the shared output: sigmoid(x w) per token.
    shared_expert_gate: bool = False
    # Expert slots per device (None = experts per device); the spare slots hold replicas
    # placed by a runtime table (jaxmoe/placement/replicas.py). Capacity is per slot.
    slots_per_device: int | None = None
    # Re-plan the replicas every this many steps from the routing counts (0: static).
    rebalance_every: int = 0
    # jaxmoe/layers/dispatchers.py. all_to_all (default): bytes ~ tokens x top_k x capacity
    # factor (x expert_tensor); all_gather: tokens x (expert x expert_tensor - 1), so it wins
    # for small MoE groups, with expert_tensor > 1, and in dropless mode.
    dispatcher: str = "all_to_all"
    # Dropless only (capacity_factor None). padded: every expert's buffer has group_size
    # slots (num_experts / top_k times the routed rows move and are multiplied). ragged:
    # only the routed rows move (ragged all-to-all) and the experts are one grouped GEMM
    # (ragged_dot); needs the all_to_all dispatcher and parallel.expert_tensor 1.
    dropless_dispatch: str = "padded"
    # ragged only: the rows a device's receive buffer holds, as a multiple of the routed
    # rows each device receives under even routing (tokens per device x top_k); never more
    # than the worst case (every token of the expert group sending its min(top_k, slots per
    # device) rows to one device). None: the worst case, which no step can exceed. A step
    # whose rows for a device exceed the buffer drops the rows past it (counted in
    # dropped_fraction, as capacity drops are).
    ragged_buffer_factor: float | None = None

    def __post_init__(self) -> None:
        check_types("moe", self)
        positive_int("moe", "num_experts", self.num_experts)
        positive_int("moe", "top_k", self.top_k)
        require(
            self.top_k <= self.num_experts,
            f"moe.top_k={self.top_k} is larger than moe.num_experts={self.num_experts}: "
            "a token cannot be sent to more experts than exist",
        )
        if self.capacity_factor is not None:
            require(
                isinstance(self.capacity_factor, int | float)
                and not isinstance(self.capacity_factor, bool)
                and self.capacity_factor > 0,
                f"moe.capacity_factor={self.capacity_factor!r}: must be > 0, "
                "or None for dropless routing",
            )
        if self.group_size is not None:
            positive_int("moe", "group_size", self.group_size)
        if self.d_expert is not None:
            positive_int("moe", "d_expert", self.d_expert)
        require(
            isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0,
            f"moe.num_shared_experts={self.num_shared_experts!r}: must be an integer >= 0",
        )
        if self.d_shared_expert is not None:
            positive_int("moe", "d_shared_expert", self.d_shared_expert)
        require(
            not self.shared_expert_gate or self.num_shared_experts > 0,
            "moe.shared_expert_gate=True gates the shared experts: set moe.num_shared_experts",
        )
        if self.slots_per_device is not None:
            positive_int("moe", "slots_per_device", self.slots_per_device)
        require(
            isinstance(self.rebalance_every, int) and self.rebalance_every >= 0,
            f"moe.rebalance_every={self.rebalance_every!r}: must be an integer >= 0 (0: static)",
        )
        one_of("moe", "dispatcher", self.dispatcher, choices.DISPATCHERS)
        one_of("moe", "dropless_dispatch", self.dropless_dispatch, DROPLESS_DISPATCHES)
        if self.dropless_dispatch == "ragged":
            require(
                self.capacity_factor is None,
                f"moe.dropless_dispatch=ragged is a dropless dispatch: set "
                f"moe.capacity_factor none (it is {self.capacity_factor}) or "
                "moe.dropless_dispatch padded",
            )
            require(
                self.dispatcher == "all_to_all",
                "moe.dropless_dispatch=ragged exchanges rows with an all-to-all: set "
                "moe.dispatcher all_to_all",
            )
        if self.ragged_buffer_factor is not None:
            require(
                self.dropless_dispatch == "ragged",
                f"moe.ragged_buffer_factor={self.ragged_buffer_factor} sizes the ragged "
                "receive buffer: set moe.dropless_dispatch ragged, or leave it none",
            )
            require(
                self.ragged_buffer_factor > 0,
                f"moe.ragged_buffer_factor={self.ragged_buffer_factor!r}: must be > 0, or "
                "none for the worst case",
            )
        one_of("moe", "score_function", self.score_function, choices.SCORE_FUNCTIONS)
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef", "expert_bias_rate"):
            non_negative("moe", name, getattr(self, name))
        require(
            isinstance(self.routed_scaling_factor, int | float)
            and not isinstance(self.routed_scaling_factor, bool)
            and self.routed_scaling_factor > 0,
            f"moe.routed_scaling_factor={self.routed_scaling_factor!r}: must be > 0",
        )
        positive_int("moe", "num_expert_groups", self.num_expert_groups)
        require(
            self.num_experts % self.num_expert_groups == 0,
            f"moe.num_expert_groups={self.num_expert_groups} does not divide "
            f"moe.num_experts={self.num_experts}: the groups must be equal",
        )
        if self.top_k_expert_groups is not None:
            positive_int("moe", "top_k_expert_groups", self.top_k_expert_groups)
            require(
                self.top_k_expert_groups <= self.num_expert_groups,
                f"moe.top_k_expert_groups={self.top_k_expert_groups} is more than the "
                f"moe.num_expert_groups={self.num_expert_groups} groups",
            )
            per_group = self.num_experts // self.num_expert_groups
            require(
                self.top_k <= self.top_k_expert_groups * per_group,
                f"moe.top_k={self.top_k} is more than the {self.top_k_expert_groups} x "
                f"{per_group} experts of the moe.top_k_expert_groups best groups: raise "
                "moe.top_k_expert_groups or lower moe.top_k",
            )
        require(
            isinstance(self.jitter, int | float) and 0 <= self.jitter < 1,
            f"moe.jitter={self.jitter!r}: must be in [0, 1)",
        )

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None


def saved_moe_fields(values: dict[str, Any]) -> dict[str, Any]:
    """A saved section's fields (``Config.to_dict``) without the research options that
    left it, where they hold the library's behaviour (every configuration written before
    they left, unless it chose otherwise); one at another value raises :class:`ConfigError`
    in one line naming it and the fix."""
    kept = {}
    for field, value in values.items():
        if field in EXPERIMENTAL_FIELDS:
            if value != _DROPPED_DEFAULTS[field]:
                raise ConfigError(f"moe.{field}={value!r}: {EXPERIMENTAL_FIELDS[field]}")
            continue
        kept[field] = value
    return kept


def capacity_per_expert(
    group_size: int, top_k: int, capacity_factor: float | None, num_experts: int
) -> int:
    """ceil(group_size * top_k * capacity_factor / num_experts); dropless: group_size.

    In dropless mode an expert can receive at most every token of the group once
    (a token's top-k experts are distinct), so ``group_size`` slots never drop.
    """
    if capacity_factor is None:
        return group_size
    return max(1, math.ceil(group_size * top_k * capacity_factor / num_experts))


def shared_width(model: ModelConfig, moe: MoEConfig) -> int:
    """The hidden width of the shared experts together (0 without them)."""
    return moe.num_shared_experts * (moe.d_shared_expert or moe.d_expert or model.d_ff)
