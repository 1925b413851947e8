"""How to schedule: the user's :class:`SchedulePolicy` (which passes run, on which cost
profile, within what memory), and the research options kept apart from it
(:class:`ExperimentalOptions`).

No JAX here (a profile is looked up, or read from its file, without it), so a caller
can check a policy before anything compiles: constructing one raises
:class:`PolicyError` naming the field and the fix, and :func:`check_policy_fields`
checks a mapping of such fields the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from scheduling import names
from scheduling.profiles import DeviceProfile, device_profile, profile_problem

if TYPE_CHECKING:
    from jax.sharding import Mesh


class PolicyError(ValueError):
    """A policy field with a value that cannot be used; ``fix`` says what to do."""

    def __init__(self, field: str, value: Any, fix: str, owner: str = "SchedulePolicy"):
        self.field, self.value, self.fix = field, value, fix
        super().__init__(f"{owner}.{field}={value!r}: {fix}")


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
    accumulation), every pass runs beside another microbatch's (two side by side, each
    next one joining as one ends: forward 0 and forward 1, then backward i and forward i+2
    in turn; in a pipelined step each tick's backward slot beside the next tick's forward
    slot), so that each one's
    all-to-alls run under the other's computation, and dW work fills the windows that
    remain (:mod:`scheduling.passes.pair_microbatches`).
    ``pair_microbatches`` adds the pairing to any other policy (``lancet``, ``comet``).
    """

    # The policy (scheduling.names.POLICIES): none is the step as written; the class
    # docstring says what each of the others does.
    name: str = "dw"
    # A name of scheduling.names.PROFILES, the path of a profile file (JSON with the fields
    # of DeviceProfile, as in scheduling/profiles/), or a DeviceProfile.
    profile: str | DeviceProfile = "a100"
    # Allowed growth of peak live bytes over the original program, as a fraction.
    max_live_bytes_growth: float = 0.1
    # How the emitted program runs its collectives (scheduling.runtime.transports):
    # "xla", XLA's async start/done pairs; "sync", the scheduled order with synchronous
    # collectives (for a JAX whose async primitives the adapter does not know).
    transport: str = "xla"
    # Reductions and gathers whose operand is smaller stay synchronous where they are.
    # Each async pair is launched on its own, so splitting many small reductions forgoes
    # XLA's combining of them into one; below latency x bandwidth they gain little
    # overlap. All-to-alls are never combined and always split.
    async_min_bytes: int = 0
    # "analytic": FLOPs and bytes over the profile. "measured": each distinct op timed
    # on this backend (scheduling.costs.profiling), cached under op_cost_cache when given.
    op_costs: str = "analytic"
    # Where measured op costs are kept between runs (a run fills it in).
    op_cost_cache: str | None = None
    # A CollectiveCurves file (scheduling.costs.link_model): measured collective costs,
    # used for the collectives it covers instead of the profile's link figures.
    link_curves: str | None = None
    # Partitioning: try only this chunk count (default: every n in 2..8 dividing the
    # batch); expert_pipeline: its pipelining degree (required).
    partition_chunks: int | None = None
    # Run each microbatch's passes beside another microbatch's (with any
    # policy but none; the pair policy always does).
    pair_microbatches: bool = False
    # A gather of sharded weights (ZeRO-3) starts where the compute before its first use
    # is estimated at this many times the gather's own time (scheduling.passes.prefetch);
    # 0: as soon as its operand exists, which for weights is the start of the step.
    prefetch_lead: float = 2.0
    # How each critical window is held in place on XLA:GPU (scheduling.names.XLA_PINS):
    # between optimization barriers (scheduling.runtime.xla_barriers), or not at all
    # ("none": XLA's scheduler orders the step).
    xla_pin: str = "barriers"
    # With barriers: compile a step for GPU twice, the second time with a latency for each
    # window's collective for XLA's latency estimator (scheduling.runtime.xla_latencies).
    xla_latencies: bool = True

    def __post_init__(self) -> None:
        check_policy_fields({item.name: getattr(self, item.name) for item in fields(self)})

    @property
    def pairs_microbatches(self) -> bool:
        """Whether the schedule interleaves microbatches."""
        return self.name == "pair" or (self.pair_microbatches and self.name != "none")

    @property
    def device_profile(self) -> DeviceProfile:
        """The profile: the one named, the one its file describes, or the one given."""
        return device_profile(self.profile)


@dataclass(frozen=True)
class ExperimentalOptions:
    """Research options, for measuring and for checking exactness; no part of a user's
    :class:`SchedulePolicy`. Passed as ``experimental=`` to :func:`scheduling.optimize`
    and :func:`scheduling.schedule`; the defaults change nothing.
    """

    # Partition every range that can be, even where the estimate does not improve (the
    # partitioning policies); the best estimate among those is kept.
    partition_always: bool = False
    # comet, lancet+comet: decompose every exchange this way ("rounds:G", "chunks:N")
    # wherever it applies, whatever the estimate.
    exchange: str | None = None
    # Hold each critical window on XLA:GPU as an XLA scheduling group instead of the
    # policy's xla_pin (scheduling.runtime.xla_groups; XLA:GPU of jax 0.10.2 crashes on
    # them, and the builds measured drop or mishandle them).
    xla_groups: bool = False
    # The emitted step's transport instead of the policy's: a connector
    # (scheduling.runtime.transports.Connector), called with the mesh by every process at
    # once, returning the factory of the transports (scheduling.runtime.transports.Transport)
    # the step traces its collectives through. The emulated cluster's socket all-to-alls
    # plug in here.
    transport: Callable[[Mesh], Callable[[], Any]] | None = None
    # dW packing (the policies that pack dW work): force each window's last candidates into
    # it (True) or not (False), instead of the shorter simulated step of the two where the
    # forced work overfills a window (scheduling.search.step_estimate.schedule_program).
    force_dw: bool | None = None

    def __post_init__(self) -> None:
        exchange = self.exchange
        if exchange is not None:
            kind, _, pieces = exchange.partition(":")
            if kind not in ("rounds", "chunks") or not pieces.isdigit() or int(pieces) < 2:
                raise PolicyError(
                    "exchange",
                    exchange,
                    "write rounds:G (G the exchange's group) or chunks:N (N >= 2), or none for "
                    "the cost model's choice",
                    owner="ExperimentalOptions",
                )

    def check(self, policy: SchedulePolicy) -> None:
        """Raise :class:`PolicyError` where an option does not apply to ``policy``."""
        for field, policies in (
            ("exchange", names.DECOMPOSING),
            ("force_dw", names.PACKING_DW),
        ):
            value = getattr(self, field)
            if value is not None and policy.name not in policies:
                *others, last = sorted(policies)
                raise PolicyError(
                    field,
                    value,
                    f"applies to the {', '.join(others)} and {last} policies, not {policy.name!r}",
                    owner="ExperimentalOptions",
                )


def check_policy_fields(fields: Mapping[str, Any]) -> None:
    """Raise :class:`PolicyError` for the first field of ``fields`` (named as in
    :class:`SchedulePolicy`; any subset) whose value cannot be used."""
    get = fields.get
    if "name" in fields and get("name") not in names.POLICIES:
        raise PolicyError("name", get("name"), f"choose one of {', '.join(names.POLICIES)}")
    if "profile" in fields:
        problem = profile_problem(get("profile"))
        if problem:
            raise PolicyError("profile", get("profile"), problem)
    for field, fix in (
        ("max_live_bytes_growth", "must be >= 0"),
        ("prefetch_lead", "must be >= 0 (0: gather as early as possible)"),
    ):
        if field in fields and (not _number(get(field)) or get(field) < 0):
            raise PolicyError(field, get(field), fix)
    if get("transport", "xla") not in names.TRANSPORTS:
        fix = f"choose one of {', '.join(names.TRANSPORTS)}"
        if get("transport") == "socket":
            fix += " (a transport of one's own, such as sockets, is ExperimentalOptions.transport)"
        raise PolicyError("transport", get("transport"), fix)
    if get("xla_pin", "barriers") not in names.XLA_PINS:
        fix = f"choose one of {', '.join(names.XLA_PINS)}"
        if get("xla_pin") == "groups":
            fix += " (scheduling groups are ExperimentalOptions.xla_groups)"
        raise PolicyError("xla_pin", get("xla_pin"), fix)
    async_min = get("async_min_bytes", 0)
    if not isinstance(async_min, int) or isinstance(async_min, bool) or async_min < 0:
        raise PolicyError("async_min_bytes", async_min, "must be an integer >= 0")
    if get("op_costs", "analytic") not in names.OP_COSTS:
        raise PolicyError("op_costs", get("op_costs"), f"choose one of {', '.join(names.OP_COSTS)}")
    for field in ("op_cost_cache", "link_curves"):
        if get(field) is not None and not isinstance(get(field), str):
            raise PolicyError(field, get(field), "a path, or none")
    for field in ("pair_microbatches", "xla_latencies"):
        if field in fields and not isinstance(get(field), bool):
            raise PolicyError(field, get(field), "true or false")
    chunks = get("partition_chunks")
    if chunks is not None and (
        not isinstance(chunks, int) or isinstance(chunks, bool) or not 2 <= chunks <= 8
    ):
        raise PolicyError(
            "partition_chunks", chunks, "choose 2..8, or none to let the search choose"
        )
    if get("name") == "expert_pipeline" and chunks is None:
        raise PolicyError(
            "partition_chunks",
            chunks,
            "expert_pipeline needs its pipelining degree: 2..8 (degree 1 is the async policy)",
        )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
