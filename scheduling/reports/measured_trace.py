"""Measured per-op times from a ``jax.profiler`` trace, set beside the cost model's estimates.

Reading. ``jax.profiler`` writes ``plugins/profile/<run>/<host>.trace.json.gz``
(Chrome trace events) beside ``<host>.xplane.pb``. Each op that XLA executes is
an event whose ``args`` name it: ``hlo_op`` (the instruction's name in the
compiled module), ``hlo_module``, and on XLA:CPU ``device_ordinal`` and ``run_id``
(one execution of the module); an event without them counts under its trace
process and as part of one execution. The step's module is the one with the most time;
only its complete executions count (a trace that starts while a step is still
running holds part of it). Times are means per device per step.

Matching. XLA op names (``fusion.12``, ``all-to-all.3``) mean nothing to the
scheduler, but every instruction of the compiled module keeps the metadata
``op_name`` of the JAX equation it came from: ``jit(f)/shard_map/<name
stack>/<primitive>`` (the emitted step is traced under each op's original
name stack). A scheduled op's *key* is ``(name_stack, primitive)`` (an async
``X_start``/``X_done`` is the collective ``X``); equal keys cannot be told
apart, so a row of the comparison is a key with all its ops. A traced XLA op
is counted under the key of its own metadata (a fusion's is that of the
instruction XLA built it around), or, when that names no scheduled op, under the
most expensive scheduled key among the instructions it calls. A scheduled key that
owns no XLA op was fused into others: its estimate joins the row of the
longest XLA op that holds it. So every measured and every estimated second is
in exactly one row, and no XLA op's time is split by a guess.

What cannot be matched is reported as such: XLA ops whose metadata names no
scheduled op (copies and layout changes XLA adds, ops XLA rewrote without
metadata, such as merged dots, and ops the cost model calls free, which the
simulated timeline leaves out), and scheduled ops in no traced XLA op (folded
away). Measured times are what the hardware did: a synchronous collective's
includes waiting for its slowest peer, and on fake CPU devices, which share
the host's cores, every op's includes waiting for a core.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduling.program.capture import COLLECTIVES
from scheduling.runtime.hlo_windows import without_window_scope

Key = tuple[str, str]  # (name stack, primitive)

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = ")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+) .*\{\s*$")
_CALLED = re.compile(r"(?:calls|body|condition)=%([\w.\-]+)")
_CALLED_LISTS = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclass
class MeasuredOps:
    """Per-op times of one module's complete executions in a trace."""

    module: str
    steps: int  # complete executions
    devices: int
    seconds: dict[str, float]  # XLA op -> mean seconds per device per execution
    step_seconds: float  # mean over executions of first op start to last op end
    # One execution on one device: (XLA op, start, seconds), start from the first op.
    timeline: list[tuple[str, float, float]] = field(default_factory=list)


def find_trace_file(path: str | Path) -> Path:
    """``path`` itself if it is a ``*.trace.json.gz``, else the newest one under it."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {path} (written by jax.profiler)")
    return found[-1]


def read_trace(path: str | Path, module: str | None = None) -> MeasuredOps:
    """Per-op times of ``module`` (default: the one with the most time) in a trace."""
    with gzip.open(find_trace_file(path), "rt") as file:
        events = json.load(file)["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    if not ops:
        raise ValueError(f"{path}: the trace holds no executed XLA ops")
    if module is None:
        busy: dict[str, float] = defaultdict(float)
        for event in ops:
            busy[event["args"]["hlo_module"]] += event["dur"]
        module = max(busy, key=busy.get)
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in ops:
        if event["args"]["hlo_module"] == module:
            runs[event["args"].get("run_id", "")].append(event)
    if not runs:
        raise ValueError(f"{path}: no executions of module {module!r}")
    complete = max(len(run) for run in runs.values())
    kept = [run for run in runs.values() if len(run) == complete]
    devices = {_device(event) for run in kept for event in run}
    total: dict[str, float] = defaultdict(float)
    for run in kept:
        for event in run:
            total[event["args"]["hlo_op"]] += event["dur"] * 1e-6
    per = len(kept) * len(devices)
    spans = [max(e["ts"] + e["dur"] for e in run) - min(e["ts"] for e in run) for run in kept]
    first_device = min(devices, key=str)
    shown = [e for e in kept[0] if _device(e) == first_device]
    shown.sort(key=lambda e: e["ts"])
    origin = shown[0]["ts"]
    return MeasuredOps(
        module=module,
        steps=len(kept),
        devices=len(devices),
        seconds={name: seconds / per for name, seconds in total.items()},
        step_seconds=sum(spans) / len(spans) * 1e-6,
        timeline=[(e["args"]["hlo_op"], (e["ts"] - origin) * 1e-6, e["dur"] * 1e-6) for e in shown],
    )


def _device(event: dict[str, Any]) -> str:
    """The device an executed op's event ran on: its ordinal, else its trace process."""
    return str(event["args"].get("device_ordinal", event.get("pid")))


def key_of(op_name: str) -> Key | None:
    """The ``(name_stack, primitive)`` an XLA ``op_name`` names, or None (no equation)."""
    scoped = op_name.split("shard_map/", 1)[-1] if "shard_map/" in op_name else op_name
    stack, _, primitive = scoped.rpartition("/")
    stack = without_window_scope(stack)  # a pinned collective's window is not its op's
    for suffix in ("_start", "_done"):
        if primitive.endswith(suffix) and primitive.removesuffix(suffix) in COLLECTIVES:
            primitive = primitive.removesuffix(suffix)
    if not primitive or primitive == "shard_map" or re.search(r"\.\d+$|^jit\(", primitive):
        return None  # only the enclosing scope, or XLA's own instruction (broadcast.104)
    return stack, primitive


@dataclass(frozen=True)
class HloOpKeys:
    own: tuple[Key, ...]  # from the instruction's own metadata (a fusion: what it is built around)
    held: frozenset[Key]  # from it and every instruction of the computations it calls


def hlo_op_keys(hlo_text: str) -> dict[str, HloOpKeys]:
    """XLA op name -> keys of the equations it holds, from a compiled module's text.

    Called computations are fusions, wrapped ops and loop bodies; a reduction's
    scalar ``to_apply`` is not followed (XLA shares one among many reductions).
    """
    own: dict[str, tuple[Key, ...]] = {}
    calls: dict[str, list[str]] = {}
    members: dict[str | None, list[str]] = defaultdict(list)
    computation = None
    for line in hlo_text.splitlines():
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            header = _COMPUTATION.match(line)
            if header is not None:
                computation = header.group(1)
            continue
        name = instruction.group(1)
        members[computation].append(name)
        keys = []
        for op_name in _OP_NAME.findall(line):
            keys += [k for k in map(key_of, op_name.split(";")) if k is not None]
        own[name] = tuple(dict.fromkeys(keys))
        called = _CALLED.findall(line)
        for listed in _CALLED_LISTS.findall(line):
            called += [c.strip().lstrip("%") for c in listed.split(",") if c.strip()]
        calls[name] = called

    memo: dict[str, frozenset[Key]] = {}

    def held(name: str, seen: frozenset[str]) -> frozenset[Key]:
        if name not in memo:
            found = set(own[name])
            for called in calls[name]:
                if called not in seen:
                    for member in members.get(called, []):
                        found |= held(member, seen | {called})
            memo[name] = frozenset(found)
        return memo[name]

    return {name: HloOpKeys(own[name], held(name, frozenset())) for name in own}


def estimated_seconds(simulated: dict[str, Any]) -> dict[Key, float]:
    """Seconds per key in a simulated timeline (:mod:`scheduling.reports.chrome_trace`).

    Waits are left out: a collective counts once, as its transfer on the link.
    """
    estimate: dict[Key, float] = defaultdict(float)
    for event in simulated["traceEvents"]:
        args = event.get("args", {})
        if event.get("ph") == "X" and event.get("cat") != "wait" and "primitive" in args:
            estimate[(args["name_stack"], args["primitive"])] += event["dur"] * 1e-6
    return dict(estimate)


def label(key: Key) -> str:
    stack, primitive = key
    return f"{primitive}@{stack}" if stack else primitive


@dataclass(frozen=True)
class OpGroup:
    """XLA ops and scheduled ops whose times can only be compared together."""

    scheduled_ops: tuple[str, ...]  # keys as "primitive@name_stack", most estimated first
    xla_ops: tuple[str, ...]  # most measured first
    estimated_seconds: float
    measured_seconds: float

    @property
    def error_seconds(self) -> float:
        return self.measured_seconds - self.estimated_seconds


@dataclass
class TraceComparison:
    module: str
    steps: int
    devices: int
    measured_step_seconds: float
    simulated_step_seconds: float
    groups: list[OpGroup]  # largest |measured - estimated| first
    unmatched_xla_ops: dict[str, float]  # measured seconds of XLA ops naming no scheduled op
    unmatched_scheduled_ops: dict[str, float]  # estimated seconds of scheduled ops in no XLA op
    traced_ops_not_in_module: list[str]  # traced names absent from the compiled text

    def table(self, max_rows: int = 15) -> str:
        def us(seconds: float) -> str:
            return f"{seconds * 1e6:>11.1f}"

        lines = [
            f"measured trace of {self.module}: {self.steps} steps on {self.devices} devices; "
            f"step {self.measured_step_seconds * 1e3:.2f} ms measured (first op to last), "
            f"{self.simulated_step_seconds * 1e3:.2f} ms simulated",
        ]
        if self.traced_ops_not_in_module:
            lines.append(
                f"warning: {len(self.traced_ops_not_in_module)} traced ops are not in this "
                "step's compiled module: the trace comes from another configuration or schedule"
            )
        header = f"{'measured us':>11} {'est. us':>11} {'meas/est':>8}  scheduled ops [XLA ops]"
        lines += ["ops the cost model mis-estimates most (per device per step):", header]
        for group in self.groups[:max_rows]:
            ratio = (
                f"{group.measured_seconds / group.estimated_seconds:>8.2f}"
                if group.estimated_seconds > 0
                else f"{'-':>8}"
            )
            scheduled = ", ".join(group.scheduled_ops[:3])
            if len(group.scheduled_ops) > 3:
                scheduled += f" +{len(group.scheduled_ops) - 3}"
            xla = ", ".join(group.xla_ops[:2]) + (
                f" +{len(group.xla_ops) - 2}" if len(group.xla_ops) > 2 else ""
            )
            lines.append(
                f"{us(group.measured_seconds)} {us(group.estimated_seconds)} {ratio}  "
                f"{scheduled} [{xla}]"
            )
        unmatched = sorted(self.unmatched_xla_ops.items(), key=lambda item: -item[1])
        lines.append(
            f"XLA ops that name no scheduled op: {len(unmatched)}, "
            f"{sum(self.unmatched_xla_ops.values()) * 1e6:.1f} us"
            + (f" (most: {', '.join(name for name, _ in unmatched[:3])})" if unmatched else "")
        )
        lines.append(
            f"scheduled ops in no traced XLA op: {len(self.unmatched_scheduled_ops)}, "
            f"{sum(self.unmatched_scheduled_ops.values()) * 1e6:.1f} us estimated"
        )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "steps": self.steps,
            "devices": self.devices,
            "measured_step_seconds": self.measured_step_seconds,
            "simulated_step_seconds": self.simulated_step_seconds,
            "groups": [
                {
                    "scheduled_ops": list(g.scheduled_ops),
                    "xla_ops": list(g.xla_ops),
                    "estimated_seconds": g.estimated_seconds,
                    "measured_seconds": g.measured_seconds,
                }
                for g in self.groups
            ],
            "unmatched_xla_ops": self.unmatched_xla_ops,
            "unmatched_scheduled_ops": self.unmatched_scheduled_ops,
            "traced_ops_not_in_module": self.traced_ops_not_in_module,
        }


@dataclass(frozen=True)
class Attribution:
    """Which traced XLA ops count under which scheduled keys (rule in the module docstring)."""

    members: dict[Key, frozenset[Key]]  # a row's anchor key -> every scheduled key in the row
    xla_ops: dict[Key, tuple[str, ...]]  # a row's anchor key -> its XLA ops, most measured first
    unmatched_xla_ops: dict[str, float]  # measured seconds of XLA ops naming no scheduled op
    unmatched_scheduled: tuple[Key, ...]  # scheduled keys in no traced XLA op

    def measured_seconds(self, measured: MeasuredOps, anchor: Key) -> float:
        return sum(measured.seconds[op] for op in self.xla_ops[anchor])


def attribute(measured: MeasuredOps, hlo_text: str, estimate: dict[Key, float]) -> Attribution:
    """Rows of scheduled keys (those ``estimate`` prices) and the XLA ops of ``measured`` that
    hold them; ``hlo_text`` is the compiled module the trace ran."""
    keys = hlo_op_keys(hlo_text)
    anchor: dict[str, Key] = {}  # XLA op -> the scheduled key it is counted under
    unmatched_xla = {}
    for xla_op, seconds in sorted(measured.seconds.items()):
        info = keys.get(xla_op)
        scheduled = [] if info is None else [k for k in info.own if k in estimate]
        if not scheduled and info is not None:
            scheduled = sorted((k for k in info.held if k in estimate), key=lambda k: -estimate[k])
        if scheduled:
            anchor[xla_op] = scheduled[0]
        else:
            unmatched_xla[xla_op] = seconds
    members: dict[Key, set[Key]] = {key: {key} for key in anchor.values()}
    unmatched_scheduled = []
    for key in sorted(estimate):
        if key in members:
            continue
        hosts = [op for op in anchor if key in keys[op].held]
        if hosts:  # fused into other ops: counted with the longest of them
            members[anchor[max(hosts, key=lambda op: (measured.seconds[op], op))]].add(key)
        else:
            unmatched_scheduled.append(key)
    xla_ops: dict[Key, list[str]] = defaultdict(list)
    for xla_op, key in anchor.items():
        xla_ops[key].append(xla_op)
    return Attribution(
        members={key: frozenset(grouped) for key, grouped in members.items()},
        xla_ops={
            key: tuple(sorted(ops, key=lambda op: -measured.seconds[op]))
            for key, ops in xla_ops.items()
        },
        unmatched_xla_ops=unmatched_xla,
        unmatched_scheduled=tuple(unmatched_scheduled),
    )


def compare(
    measured: MeasuredOps, hlo_text: str, simulated: dict[str, Any], simulated_step_seconds: float
) -> TraceComparison:
    """Group measured XLA ops with the scheduled ops they hold (rule in the module docstring)."""
    estimate = estimated_seconds(simulated)
    rows = attribute(measured, hlo_text, estimate)
    groups = [
        OpGroup(
            scheduled_ops=(
                label(key),
                *(label(k) for k in sorted(grouped - {key}, key=lambda k: -estimate[k])),
            ),
            xla_ops=rows.xla_ops[key],
            estimated_seconds=sum(estimate[k] for k in grouped),
            measured_seconds=rows.measured_seconds(measured, key),
        )
        for key, grouped in rows.members.items()
    ]
    groups.sort(key=lambda g: -abs(g.error_seconds))
    module_ops = hlo_op_keys(hlo_text)
    return TraceComparison(
        module=measured.module,
        steps=measured.steps,
        devices=measured.devices,
        measured_step_seconds=measured.step_seconds,
        simulated_step_seconds=simulated_step_seconds,
        groups=groups,
        unmatched_xla_ops=rows.unmatched_xla_ops,
        unmatched_scheduled_ops={label(key): estimate[key] for key in rows.unmatched_scheduled},
        traced_ops_not_in_module=sorted(op for op in measured.seconds if op not in module_ops),
    )


def side_by_side(simulated: dict[str, Any], measured: MeasuredOps) -> dict[str, Any]:
    """One Chrome trace: the simulated timeline, and one measured step on one device."""
    events = [dict(event) for event in simulated["traceEvents"]]
    events += [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "measured (one device)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "XLA ops"}},
    ]
    events += [
        {"ph": "X", "pid": 1, "tid": 0, "name": name, "ts": start * 1e6, "dur": seconds * 1e6}
        for name, start, seconds in measured.timeline
    ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}
