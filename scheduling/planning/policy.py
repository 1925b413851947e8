"""How to schedule: which passes run, on which cost profile, within what memory.

No JAX here (the profile is looked up by name when it is used), so a caller can
check a policy, or its own copy of these fields, before anything compiles:
:func:`check_policy_fields` raises :class:`PolicyError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduling import names

if TYPE_CHECKING:
    from scheduling.costs.profiles import DeviceProfile


class PolicyError(ValueError):
    """A policy field with a value that cannot be used; ``fix`` says what to do."""

    def __init__(self, field: str, value: Any, fix: str):
        self.field, self.value, self.fix = field, value, fix
        super().__init__(f"SchedulePolicy.{field}={value!r}: {fix}")


@dataclass(frozen=True)
class SchedulePolicy:
    """``none``: the original order, synchronous collectives (the reference).
    ``async``: every collective split into start/done, started early, waited late.
    ``dw``: ``async`` plus dW work packed into the backward all-to-all windows.
    ``partition``: ``async`` plus forward ranges around each MoE layer cut into chunks
    and pipelined, where the cost model says it pays (Lancet's forward pass).
    ``lancet``: ``partition`` and ``dw`` together.
    ``expert_pipeline``: the Tutel-style baseline: only each MoE layer's dispatch
    all-to-all, experts and return all-to-all, cut into ``partition_chunks`` chunks
    (the pipelining degree), with no search.
    ``comet``: ``async`` plus each MoE layer's exchange, forward and backward,
    decomposed so that the expert computation runs piece by piece as its tokens
    arrive (per-source rounds or chunks, chosen per layer by the cost model).
    ``lancet+comet``: the best of ``lancet``, ``comet`` and the two composed.
    ``pair``: ``dw`` across microbatches: with a step of several microbatches (gradient
    accumulation), every pass runs beside another microbatch's (forward 0 with forward 1,
    backward i with forward i+2, the last two backward passes together; in a pipelined
    step each tick's backward slot with the next tick's forward slot), so that each one's
    all-to-alls run under the other's computation, and dW work fills the windows that
    remain (:mod:`scheduling.passes.pair_microbatches`).
    ``pair_microbatches`` adds the pairing to any other policy (``lancet``, ``comet``).
    """

    name: str = "dw"
    # A name of scheduling.names.PROFILES, or a DeviceProfile.
    profile: DeviceProfile | str = "a100"
    # The cost model's link in Mbit/s per device instead of the profile's (0: the profile's).
    link_mbit: float = 0.0
    # Allowed growth of peak live bytes over the original program, as a fraction.
    max_live_bytes_growth: float = 0.1
    # How the emitted program runs its collectives (scheduling.runtime.transports):
    # "xla", XLA's async start/done pairs; "sync", the planned order with synchronous
    # collectives (for a JAX whose async primitives the adapter does not know); "socket",
    # on the CPU backend across processes, the all-to-alls as socket start/done pairs,
    # which overlap the computation planned between them where XLA:CPU runs its own
    # pairs synchronously (elsewhere "xla"). With "socket", ``none`` runs each
    # all-to-all over the sockets with its done right after its start.
    transport: str = "xla"
    # Reductions and gathers whose operand is smaller stay synchronous where they are.
    # Each async pair is launched on its own, so splitting many small reductions forgoes
    # XLA's combining of them into one; below latency x bandwidth they gain little
    # overlap. All-to-alls are never combined and always split.
    async_min_bytes: int = 0
    # "analytic": FLOPs and bytes over the profile. "measured": each distinct op timed
    # on this backend (scheduling.costs.profiling), cached under op_cost_cache when given.
    op_costs: str = "analytic"
    op_cost_cache: str | None = None
    # A CollectiveCurves file (scheduling.costs.link_model): measured collective costs,
    # used for the collectives it covers instead of the profile's link figures.
    link_curves: str | None = None
    # Partitioning: try only this chunk count (default: every n in 2..8 dividing the
    # batch); expert_pipeline: its pipelining degree (required).
    partition_chunks: int | None = None
    # Partition every range that can be, even where the estimate does not improve (for
    # measuring, and for checking exactness); the best estimate among those is kept.
    partition_always: bool = False
    # comet: decompose every exchange this way ("rounds:G", "chunks:N") wherever it applies,
    # whatever the estimate (for measuring, and for checking exactness).
    exchange: str | None = None
    # Run each microbatch's passes beside another microbatch's (with any
    # policy but none; the pair policy always does).
    pair_microbatches: bool = False
    # A gather of sharded weights (ZeRO-3) starts where the compute before its first use
    # is estimated at this many times the gather's own time (scheduling.passes.prefetch);
    # 0: as soon as its operand exists, which for weights is the start of the step.
    prefetch_lead: float = 2.0
    # How each critical window is held in place on XLA:GPU (scheduling.names.XLA_PINS):
    # between optimization barriers (scheduling.runtime.xla_barriers), as a scheduling
    # group (scheduling.runtime.xla_groups), or not at all ("none": XLA's scheduler
    # orders the step).
    xla_pin: str = "barriers"
    # With barriers: compile a step for GPU twice, the second time with a latency for each
    # window's collective for XLA's latency estimator (scheduling.runtime.xla_latencies).
    xla_latencies: bool = True

    def __post_init__(self) -> None:
        check_policy_fields(
            {name: getattr(self, name) for name in self.__dataclass_fields__},
        )

    @property
    def pairs_microbatches(self) -> bool:
        """Whether the plan interleaves microbatches."""
        return self.name == "pair" or (self.pair_microbatches and self.name != "none")

    @property
    def device_profile(self) -> DeviceProfile:
        """The profile, with ``link_mbit`` applied."""
        from scheduling.costs.profiles import PROFILES  # JAX: only when costs are needed

        profile = PROFILES[self.profile] if isinstance(self.profile, str) else self.profile
        return profile.with_link(self.link_mbit * 1e6 / 8) if self.link_mbit else profile


def check_policy_fields(fields: Mapping[str, Any]) -> None:
    """Raise :class:`PolicyError` for the first field of ``fields`` (named as in
    :class:`SchedulePolicy`; any subset) whose value cannot be used."""
    get = fields.get
    if "name" in fields and get("name") not in names.POLICIES:
        raise PolicyError("name", get("name"), f"choose one of {', '.join(names.POLICIES)}")
    profile = get("profile")
    if isinstance(profile, str) and profile not in names.PROFILES:
        raise PolicyError(
            "profile", profile, f"choose one of {', '.join(names.PROFILES)} or a DeviceProfile"
        )
    if not _number(get("link_mbit", 0)) or get("link_mbit", 0) < 0:
        raise PolicyError("link_mbit", get("link_mbit"), "must be >= 0 (0 keeps the profile's)")
    if not _number(get("max_live_bytes_growth", 0)) or get("max_live_bytes_growth", 0) < 0:
        raise PolicyError("max_live_bytes_growth", get("max_live_bytes_growth"), "must be >= 0")
    if not _number(get("prefetch_lead", 0)) or get("prefetch_lead", 0) < 0:
        raise PolicyError(
            "prefetch_lead", get("prefetch_lead"), "must be >= 0 (0: gather as early as possible)"
        )
    if get("transport", "xla") not in names.TRANSPORTS:
        raise PolicyError(
            "transport", get("transport"), f"choose one of {', '.join(names.TRANSPORTS)}"
        )
    if get("xla_pin", "barriers") not in names.XLA_PINS:
        raise PolicyError("xla_pin", get("xla_pin"), f"choose one of {', '.join(names.XLA_PINS)}")
    async_min = get("async_min_bytes", 0)
    if not isinstance(async_min, int) or isinstance(async_min, bool) or async_min < 0:
        raise PolicyError("async_min_bytes", async_min, "must be an integer >= 0")
    if get("op_costs", "analytic") not in names.OP_COSTS:
        raise PolicyError("op_costs", get("op_costs"), f"choose one of {', '.join(names.OP_COSTS)}")
    chunks = get("partition_chunks")
    if chunks is not None and (not isinstance(chunks, int) or not 2 <= chunks <= 8):
        raise PolicyError(
            "partition_chunks", chunks, "choose 2..8, or none to let the search choose"
        )
    if get("name") == "expert_pipeline" and chunks is None:
        raise PolicyError(
            "partition_chunks",
            chunks,
            "expert_pipeline needs its pipelining degree: 2..8 (degree 1 is the async policy)",
        )
    exchange = get("exchange")
    if exchange is not None:
        kind, _, pieces = exchange.partition(":")
        if kind not in ("rounds", "chunks") or not pieces.isdigit() or int(pieces) < 2:
            raise PolicyError(
                "exchange",
                exchange,
                "write rounds:G (G the exchange's group) or chunks:N (N >= 2), or none for "
                "the cost model's choice",
            )
        if "name" in fields and get("name") not in names.DECOMPOSING:
            raise PolicyError(
                "exchange",
                exchange,
                f"applies to the {' and '.join(sorted(names.DECOMPOSING))} policies, not "
                f"{get('name')!r}",
            )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
