"""The schedule section: how the scheduling layer rewrites the train step.

One field for each field of :class:`scheduling.SchedulePolicy` (the same names, the
same meaning, checked by the same code: :func:`scheduling.check_policy_fields`),
except ``op_cost_cache``, which the run fills in. ``--schedule NAME`` is the shortcut
for ``--schedule.name NAME``; the README's schedule table says what each policy does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import scheduling
from jaxmoe.config.checks import ConfigError, check_types


@dataclass(frozen=True)
class ScheduleConfig:
    """The scheduling policy of the run, field for field (see the module docstring)."""

    # The scheduling policy: none is the step as written (plain jit); the README's schedules
    # table says what each of the others does.
    name: str = "none"
    # The device profile of the cost model (scheduling.names.PROFILES).
    profile: str = "a100"
    # The cost model's link in Mbit/s per device instead of the profile's (0: the profile's).
    link_mbit: float = 0.0
    # Allowed growth of peak live bytes over the step as written, as a fraction.
    max_live_bytes_growth: float = 0.1
    # xla (XLA's async collectives), sync (the planned order, synchronous collectives), or
    # socket (on the CPU backend across processes, the all-to-alls over sockets, where
    # they overlap computation; `none` then runs them synchronously on the same sockets).
    transport: str = "xla"
    # Reductions and gathers smaller than this stay synchronous (and combinable by XLA).
    async_min_bytes: int = 0
    # Op costs: analytic (the profile's FLOPs and bytes) or measured on this backend.
    op_costs: str = "analytic"
    # Measured collective curves (`jaxmoe link-curves`) instead of the profile's link.
    link_curves: str | None = None
    # partition, lancet: the chunk count to use (none: the search picks from 2..8);
    # expert_pipeline: its degree (required).
    partition_chunks: int | None = None
    # Partition every range that can be, even where the estimate does not improve.
    partition_always: bool = False
    # comet, lancet+comet: decompose every MoE exchange this way ("rounds:G", "chunks:N";
    # none: the cost model chooses per layer).
    exchange: str | None = None
    # Run each microbatch's passes beside another microbatch's (with
    # train.microbatches > 1; the pair policy always does, any other but none may).
    pair_microbatches: bool = False
    # train.zero 3: each block's weight gather starts where the compute before its use is
    # estimated at this many times the gather's time (0: at the start of the step).
    prefetch_lead: float = 2.0
    # On GPU, how each critical window is held in place against XLA's own scheduler:
    # barriers (optimization barriers around it), groups (XLA scheduling groups) or none.
    xla_pin: str = "barriers"
    # With barriers on GPU: compile twice, telling XLA's scheduler the second time that each
    # window's collective lasts longer than anything beside it, so that it opens each
    # window where the plan does.
    xla_latencies: bool = True

    def __post_init__(self) -> None:
        check_types("schedule", self)
        try:
            scheduling.check_policy_fields(dataclasses.asdict(self))
        except scheduling.PolicyError as error:
            raise ConfigError(f"schedule.{error.field}={error.value!r}: {error.fix}") from None

    def policy(self, op_cost_cache: str | None = None) -> scheduling.SchedulePolicy:
        """The scheduling policy these fields describe."""
        return scheduling.SchedulePolicy(**dataclasses.asdict(self), op_cost_cache=op_cost_cache)

    @property
    def rewrites(self) -> bool:
        """Whether the step goes through the scheduling layer (anything but the plain jit)."""
        return self.name != "none" or self.transport == "socket"


# Fields of the train section that the schedule section took over, and their new names;
# a saved configuration that has them is read into the schedule section.
RENAMED_TRAIN_FIELDS = {
    "schedule": "name",
    "schedule_profile": "profile",
    "schedule_async_min_bytes": "async_min_bytes",
    "schedule_op_costs": "op_costs",
    "schedule_link_curves": "link_curves",
    "schedule_link_mbit": "link_mbit",
    "schedule_partition_chunks": "partition_chunks",
    "schedule_partition_always": "partition_always",
    "schedule_socket_all_to_all": "transport",
    "schedule_exchange": "exchange",
}


def schedule_fields_from_train(train: dict) -> dict:
    """The schedule section's values from a train section written before it existed
    (``train.schedule_*``), removed from ``train``; unset values become None."""
    fields = {}
    for old, new in RENAMED_TRAIN_FIELDS.items():
        if old not in train:
            continue
        value = train.pop(old)
        if old == "schedule_socket_all_to_all":
            value = "socket" if value else "xla"
        elif old in ("schedule_partition_chunks", "schedule_exchange") and not value:
            value = None
        fields[new] = value
    return fields
