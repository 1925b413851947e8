"""How to schedule: which passes run, on which cost profile, within what memory."""

from __future__ import annotations

from dataclasses import dataclass

from scheduling.costs.profiles import PROFILES, DeviceProfile

POLICIES = (
    "none", "async", "dw", "partition", "lancet", "expert_pipeline", "comet", "lancet+comet"
)  # fmt: skip
# Policies that partition forward ranges around the MoE layers, and that pack dW work.
PARTITIONING = frozenset({"partition", "lancet", "expert_pipeline", "lancet+comet"})
PACKING_DW = frozenset({"dw", "lancet"})


@dataclass(frozen=True)
class SchedulePolicy:
    """``none``: the original order, synchronous collectives (the reference); with
    ``socket_all_to_all``, its all-to-alls run synchronously over the sockets, so that
    the reference uses the transport of the scheduled steps.
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
    """

    name: str = "dw"
    profile: DeviceProfile | str = "a100"
    # Allowed growth of peak live bytes over the original program, as a fraction.
    max_live_bytes_growth: float = 0.1
    # On a JAX without known async primitives: keep the order with sync collectives.
    fallback_to_sync: bool = False
    # Reductions and gathers whose operand is smaller stay synchronous where they are.
    # Each async pair is launched on its own, so splitting many small reductions forgoes
    # XLA's combining of them into one; below latency x bandwidth they gain little
    # overlap. All-to-alls are never combined and always split.
    async_min_bytes: int = 0
    # "analytic": FLOPs and bytes over the profile. "measured": each distinct op timed
    # on this backend (scheduling.costs.profiling), cached under op_cost_cache when given.
    op_costs: str = "analytic"
    op_cost_cache: str | None = None
    # A CollectiveCurves file (scheduling.costs.link_model): measured collective costs, used
    # for the collectives it covers instead of the profile's link figures.
    collective_curves: str | None = None
    # Partitioning: try only this chunk count (default: every n in 2..8 dividing the batch).
    partition_chunks: int | None = None
    # Partition every range that can be, even where the estimate does not improve (for
    # measuring, and for checking exactness); the best estimate among those is kept.
    partition_always: bool = False
    # On the CPU backend across processes: all-to-alls as socket start/done pairs
    # (scheduling.runtime.socket_all_to_all), which overlap the computation planned between
    # them; XLA:CPU runs its own async pairs synchronously. Ignored elsewhere. ``none``
    # then runs each all-to-all over the sockets with its done right after its start.
    socket_all_to_all: bool = False
    # comet: decompose every exchange this way ("rounds:G", "chunks:N") wherever it applies,
    # whatever the estimate (for measuring, and for checking exactness).
    exchange_decomposition: str | None = None

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(
                f"SchedulePolicy.name={self.name!r}: choose one of {', '.join(POLICIES)}"
            )
        if isinstance(self.profile, str) and self.profile not in PROFILES:
            raise ValueError(
                f"SchedulePolicy.profile={self.profile!r}: choose one of "
                f"{', '.join(sorted(PROFILES))} or pass a DeviceProfile"
            )
        if self.max_live_bytes_growth < 0:
            raise ValueError("SchedulePolicy.max_live_bytes_growth must be >= 0")
        if self.async_min_bytes < 0:
            raise ValueError("SchedulePolicy.async_min_bytes must be >= 0")
        if self.partition_chunks is not None and not 2 <= self.partition_chunks <= 8:
            raise ValueError(
                f"SchedulePolicy.partition_chunks={self.partition_chunks}: choose 2..8, or None "
                "to let the search choose"
            )
        if self.name == "expert_pipeline" and self.partition_chunks is None:
            raise ValueError(
                "SchedulePolicy.partition_chunks: expert_pipeline needs the pipelining degree "
                "(2..8; degree 1 is the 'async' policy)"
            )
        if self.exchange_decomposition is not None:
            kind, _, pieces = self.exchange_decomposition.partition(":")
            if kind not in ("rounds", "chunks") or not pieces.isdigit() or int(pieces) < 2:
                raise ValueError(
                    f"SchedulePolicy.exchange_decomposition={self.exchange_decomposition!r}: "
                    "write 'rounds:G' (G the exchange's group) or 'chunks:N' (N >= 2)"
                )
            if self.name not in ("comet", "lancet+comet"):
                raise ValueError(
                    "SchedulePolicy.exchange_decomposition applies to the comet and "
                    f"lancet+comet policies, not {self.name!r}"
                )
        if self.op_costs not in ("analytic", "measured"):
            raise ValueError(
                f"SchedulePolicy.op_costs={self.op_costs!r}: choose 'analytic' or 'measured'"
            )

    @property
    def device_profile(self) -> DeviceProfile:
        return PROFILES[self.profile] if isinstance(self.profile, str) else self.profile
