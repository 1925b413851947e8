"""What a schedule does, per collective and in total, as a table and as JSON."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class CollectiveReport:
    index: int
    kind: str  # primitive: all_to_all, psum, ...
    phase: str  # forward, backward, optimizer
    layer: str
    bytes: int  # bytes this device sends
    estimated_seconds: float
    is_async: bool
    placed_ops: list[str]  # "primitive@layer" of the dW work placed in its window
    placed_seconds: float
    # Of estimated_seconds, how much the compute stream did not wait for (duration minus
    # the stall at its done, at least 0; a stall can include waiting behind another
    # collective on the link).
    overlap_seconds: float
    deferrable: bool = False  # served after the critical collectives (a gradient reduction)
    why: str = ""  # why the overlap is what it is (see scheduling.reports.describe)
    axes: list[str] = field(default_factory=list)  # the mesh axes of its group
    # What it is for, e.g. "tensor all_gather (sequence)"
    # (see scheduling.program.collective_purpose)
    purpose: str = ""


@dataclass
class PartitionReport:
    """One forward range cut into chunks (``partition`` and ``lancet`` policies)."""

    first_op: str  # "index:primitive@layer" in the captured program
    last_op: str
    layers: list[str]  # layers of its chunked ops
    chunks: int
    ops: int  # ops in the range
    chunked_ops: int
    deferred_ops: int  # ops run once after the chunks (reductions over the batch)
    estimated_seconds: float  # the range chunked, on two streams
    unpartitioned_seconds: float
    estimated_gain_seconds: float


@dataclass
class ExchangeReport:
    """One MoE layer's exchange regions, forward and backward (``comet`` policies)."""

    layer: str
    phases: list[str]  # of its exchanges, in program order
    # "rounds:G", "chunks:N", "... (forward only)", "... (backward only)", or "none"
    decomposition: str
    undecomposed_seconds: float  # its regions alone, as captured, on two streams, summed
    estimated_seconds: float  # the regions as scheduled
    estimated_gain_seconds: float
    candidates: dict[str, float]  # every decomposition that applies -> its estimate
    why: str = ""  # why it was left undecomposed (or "forced")


@dataclass
class ScheduleReport:
    policy: str
    profile: str
    collectives: list[CollectiveReport]
    ops: int
    compute_seconds: float
    communication_seconds: float
    step_seconds: float
    baseline_step_seconds: float  # the original order, every collective synchronous
    # The simulator's lower bound for any schedule of the original program: the larger of
    # its compute time and its communication time, each stream busy all the time and every
    # collective hidden. (Partitioning only adds work: launches, cuts, joins, latencies.)
    ideal_step_seconds: float
    dw_ops: int  # backward ops that qualify as dW for some backward all-to-all
    dw_ops_placed: int
    forced_placements: int
    withdrawn_placements: int  # undone: cycles between windows, then the live-bytes bound
    peak_live_bytes: int
    baseline_peak_live_bytes: int
    live_bytes_bound_exceeded: bool  # by early starts alone (nothing left to withdraw)
    # Time the compute stream waits for communication (the simulated timeline's stalls).
    exposed_communication_seconds: float
    not_understood: list[str] = field(default_factory=list)  # opaque ops, collectives w/o async
    kept_synchronous: list[str] = field(default_factory=list)  # by policy (kinds, min bytes)
    partitions: list[PartitionReport] = field(default_factory=list)
    exchanges: list[ExchangeReport] = field(default_factory=list)
    # The simulated timeline as a Chrome trace (see scheduling.reports.chrome_trace); not
    # part of to_json.
    trace: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def overlap_seconds(self) -> float:
        return self.communication_seconds - self.exposed_communication_seconds

    def totals(self) -> dict[str, Any]:
        kinds = Counter(c.kind for c in self.collectives)
        return {
            "collectives": len(self.collectives),
            "by_kind": dict(sorted(kinds.items())),
            "async": sum(c.is_async for c in self.collectives),
            "communication_seconds": self.communication_seconds,
            "overlap_seconds": self.overlap_seconds,
            "exposed_communication_seconds": self.exposed_communication_seconds,
            "compute_seconds": self.compute_seconds,
            # Idle: the step minus the time each stream is busy (compute waits included).
            "compute_idle_seconds": self.step_seconds - self.compute_seconds,
            "communication_idle_seconds": self.step_seconds - self.communication_seconds,
            "step_seconds": self.step_seconds,
            "baseline_step_seconds": self.baseline_step_seconds,
            "ideal_step_seconds": self.ideal_step_seconds,
            "dw_ops": self.dw_ops,
            "dw_ops_placed": self.dw_ops_placed,
        }

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["trace"]
        data["totals"] = self.totals()
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def save_trace(self, path: str | Path) -> None:
        """The simulated timeline, for https://ui.perfetto.dev or chrome://tracing."""
        Path(path).write_text(json.dumps(self.trace) + "\n")

    def save_gantt(self, path: str | Path) -> None:
        """The simulated timeline as a Gantt chart (PNG; needs matplotlib)."""
        from scheduling.reports.gantt import gantt_png

        gantt_png(self.trace, path, title=f"schedule '{self.policy}' on {self.profile}")

    def table(self, max_rows: int | None = None) -> str:
        """A readable table: one row per collective, then the totals."""
        header = (
            f"{'#':>4} {'purpose':<34} {'axes':<24} {'phase':<9} {'layer':<24} {'KiB':>9} "
            f"{'est us':>9} {'async':<5} {'placed':>6} {'overlap us':>10}  why"
        )
        lines = [f"schedule '{self.policy}' on profile '{self.profile}'", header, "-" * len(header)]
        rows = self.collectives if max_rows is None else self.collectives[:max_rows]
        for c in rows:
            axes = ",".join(c.axes) or "-"
            lines.append(
                f"{c.index:>4} {(c.purpose or c.kind)[:34]:<34} {axes[-24:]:<24} {c.phase:<9} "
                f"{c.layer[-24:]:<24} "
                f"{c.bytes / 1024:>9.1f} {c.estimated_seconds * 1e6:>9.1f} "
                f"{'yes' if c.is_async else 'no':<5} {len(c.placed_ops):>6} "
                f"{c.overlap_seconds * 1e6:>10.1f}  {c.why}"
            )
        if max_rows is not None and len(self.collectives) > max_rows:
            lines.append(f"  ... {len(self.collectives) - max_rows} more collectives")
        t = self.totals()
        lines += [
            "-" * len(header),
            f"collectives {t['collectives']} {t['by_kind']}, async {t['async']}",
            f"communication {t['communication_seconds'] * 1e6:.1f} us, overlapped "
            f"{t['overlap_seconds'] * 1e6:.1f} us, exposed "
            f"{t['exposed_communication_seconds'] * 1e6:.1f} us",
            f"estimated step {t['step_seconds'] * 1e6:.1f} us (unscheduled "
            f"{t['baseline_step_seconds'] * 1e6:.1f} us, ideal "
            f"{t['ideal_step_seconds'] * 1e6:.1f} us), compute {t['compute_seconds'] * 1e6:.1f} us",
            f"dW ops placed {self.dw_ops_placed} of {self.dw_ops} (forced "
            f"{self.forced_placements}, withdrawn {self.withdrawn_placements}); "
            f"peak live {self.peak_live_bytes / 2**20:.1f} MiB "
            f"(was {self.baseline_peak_live_bytes / 2**20:.1f})"
            + (", over the bound by early starts alone" if self.live_bytes_bound_exceeded else ""),
        ]
        for p in self.partitions:
            lines.append(
                f"partitioned {p.first_op} .. {p.last_op} ({', '.join(p.layers)}) into "
                f"{p.chunks} chunks: {p.chunked_ops} of {p.ops} ops chunked, "
                f"{p.deferred_ops} deferred; estimate {p.estimated_seconds * 1e6:.1f} us "
                f"(was {p.unpartitioned_seconds * 1e6:.1f}, gain "
                f"{p.estimated_gain_seconds * 1e6:.1f})"
            )
        for x in self.exchanges:
            tried = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in x.candidates.items()) or "none"
            lines.append(
                f"MoE layer {x.layer} ({', '.join(x.phases)}): {x.decomposition}, estimate "
                f"{x.estimated_seconds * 1e6:.1f} us (was {x.undecomposed_seconds * 1e6:.1f}, "
                f"gain {x.estimated_gain_seconds * 1e6:.1f}); tried: {tried}"
                + (f"; {x.why}" if x.why else "")
            )
        if self.kept_synchronous:
            lines.append(f"kept synchronous by policy: {len(self.kept_synchronous)} collectives")
        if self.not_understood:
            lines.append(f"left in place (not understood): {', '.join(self.not_understood)}")
        return "\n".join(lines)
