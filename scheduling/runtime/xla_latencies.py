"""The schedule's windows, handed to XLA:GPU's scheduler as a latency profile.

Barriers (:mod:`scheduling.runtime.xla_barriers`) bound each window's computation to
after its collective's operand exists and before its result is read; how early inside
that span the collective starts is the latency-hiding scheduler's choice. It starts a
collective once its estimate of the collective's time is covered by the computation it
has placed after the start, and its estimates are its own: a fixed guess for each
collective, a nominal cost for each instruction. Told a collective's scheduled time, it
still starts it late wherever it counts more computation in the window than that time
(the schedule fills a window with all the computation it can hold), and part of the
window's computation runs before the collective.

So each pinned window's start is told a latency nothing between its barriers can cover
(:func:`window_latencies`): the scheduler then starts the collective at its barrier,
where the schedule starts it, and what it places inside is the computation the barriers
bound. Nothing covers the schedule's time of the whole step run serially, but one latency
for all is not enough where windows overlap: the scheduler works from the end of the
step backwards, and where it places a start whose latency is not covered it advances
its clock to that start's due time, a stall that counts for every collective still
open. A window opened before a later one's start and told the same latency would be
covered by that stall a few instructions later and started there. So the windows'
latencies grow towards the start of the step by the serial step each: window ``k`` of
``n`` (numbered in the order of the starts) is told ``n - k`` serial steps, more than
any stall of the windows after it.

XLA's profile-guided latency estimator takes instruction costs from a
``ProfiledInstructionsProto`` (text: ``costs { name: "..." cost_us: ... }``), by the
names of the instructions of the module it schedules, and falls back to its own
estimate for any other. Those names exist only once the module is compiled, and
compiling the same module again gives the same names: so a scheduled step is compiled
once, the start of each marked window is found in the compiled module (by its
``_scheduled_window`` attribute) and given its latency, and the step is compiled again
with that profile (:data:`PROFILE_OPTION`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from scheduling.program.capture import Op
from scheduling.program.graph import Graph, Role
from scheduling.runtime.hlo_windows import entry_instructions, parse_instruction, windows

# The XLA debug option naming the profile, passed to one compile as a compiler option.
PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"


def window_latencies(
    graph: Graph, count: int, op_seconds: Callable[[Op], float]
) -> dict[int, float]:
    """The latency the start of each of ``count`` pinned windows (numbered in the order
    of the starts) is told: ``count - k`` times the schedule's time of every op of ``graph``
    run one after another (a split collective counted once)."""
    serial = sum(op_seconds(node.op) for node in graph.nodes if node.role is not Role.DONE)
    return {k: serial * (count - k) for k in range(count)}


def latency_profile(compiled_text: str, seconds: Mapping[int, float]) -> str:
    """A profile giving the start of each window of ``seconds`` (window -> the latency
    its collective is told) found in ``compiled_text`` that latency; empty where none
    is found (a module with no async collective, as on XLA:CPU)."""
    lines = entry_instructions(compiled_text)
    costs = []
    for number, window in sorted(windows(compiled_text).items()):
        if window.start is None or number not in seconds:
            continue
        start = parse_instruction(lines[window.start])
        costs.append(f'costs {{ name: "{start.name}" cost_us: {seconds[number] * 1e6:.3f} }}')
    return "\n".join(costs) + "\n" if costs else ""


def compile_with_latencies(
    lowered: Any, seconds: Mapping[int, float], options: Mapping[str, Any] | None = None
) -> Any:
    """Compile ``lowered`` (a ``jax.stages.Lowered``) with the compiler ``options``, and
    where the compiled module has windows of ``seconds``, compile it again with their
    latencies."""
    options = dict(options or {})
    compiled = lowered.compile(compiler_options=options or None)
    if not seconds:
        return compiled
    profile = latency_profile(compiled.as_text(), seconds)
    if not profile:
        return compiled
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "scheduled_latencies.pbtxt"
        path.write_text(profile)
        return lowered.compile(compiler_options={**options, PROFILE_OPTION: str(path)})
