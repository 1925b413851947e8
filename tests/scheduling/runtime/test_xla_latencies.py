"""The windows' latencies as XLA:GPU's latency profile: found by the windows' marks in
the compiled module, handed to a second compile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduling.program.graph import Role
from scheduling.runtime.xla_latencies import (
    PROFILE_OPTION,
    compile_with_latencies,
    latency_profile,
    window_latencies,
)

T = "f32[8,4]{1,0}"
W = 'frontend_attributes={{_scheduled_window="{}"}}'
COMPILED = f"""HloModule step, is_scheduled=true

ENTRY %main (p0: f32[8,4]) -> f32[8,4] {{
  %p0 = {T} parameter(0)
  %all-to-all-start.3 = ({T}, {T}) all-to-all-start(%p0), {W.format(0)}
  %dot.1 = {T} dot(%p0, %p0), {W.format(0)}
  %all-to-all-done.3 = {T} all-to-all-done(%all-to-all-start.3), {W.format(0)}
  %all-reduce-start = {T} all-reduce-start(%dot.1), {W.format(1)}
  %dot.2 = {T} dot(%dot.1, %p0), {W.format(1)}
  %all-reduce-done = {T} all-reduce-done(%all-reduce-start), {W.format(1)}
  %ag-start = ({T}, {T}) all-gather-start(%p0)
  %ag-done = {T} all-gather-done(%ag-start)
  ROOT %add = {T} add(%all-to-all-done.3, %all-reduce-done)
}}
"""


def test_earlier_windows_are_told_longer_latencies_than_the_serial_steps_after_them():
    """Three windows over a step of 1 ms of computation and two split collectives of
    2 ms (each counted once): the serial step is 5 ms; window k of 3 is told 3 - k."""
    nodes = [SimpleNamespace(op=("compute", 1e-3), role=Role.COMPUTE)]
    for _ in range(2):
        nodes.append(SimpleNamespace(op=("collective", 2e-3), role=Role.START))
        nodes.append(SimpleNamespace(op=("collective", 2e-3), role=Role.DONE))
    latencies = window_latencies(SimpleNamespace(nodes=nodes), 3, lambda op: op[1])
    assert latencies == pytest.approx({0: 15e-3, 1: 10e-3, 2: 5e-3})
    assert window_latencies(SimpleNamespace(nodes=nodes), 0, lambda op: op[1]) == {}


def test_each_windows_start_gets_its_latency_in_microseconds():
    profile = latency_profile(COMPILED, {0: 250e-6, 1: 1.5e-3})
    assert profile == (
        'costs { name: "all-to-all-start.3" cost_us: 250.000 }\n'
        'costs { name: "all-reduce-start" cost_us: 1500.000 }\n'
    )
    # A window without a scheduled time, and an unmarked collective, are left to XLA.
    assert "all-reduce-start" not in latency_profile(COMPILED, {0: 1e-4})
    assert latency_profile(COMPILED.replace("_scheduled_window", "other"), {0: 1e-4}) == ""


class _Lowered:
    """Records the compiles of a lowered step; each returns the module above."""

    def __init__(self, text: str):
        self.text, self.options = text, []

    def compile(self, compiler_options=None):
        self.options.append(compiler_options)
        if PROFILE_OPTION in (compiler_options or {}):  # it exists while its compile runs
            with open(compiler_options[PROFILE_OPTION]) as file:
                self.profile = file.read()
        return self

    def as_text(self) -> str:
        return self.text


def test_a_step_with_windows_is_compiled_again_with_their_times():
    lowered = _Lowered(COMPILED)
    assert compile_with_latencies(lowered, {0: 1e-4}) is lowered
    assert lowered.options[0] is None and set(lowered.options[1]) == {PROFILE_OPTION}
    assert lowered.profile == 'costs { name: "all-to-all-start.3" cost_us: 100.000 }\n'
    # Nothing found to time (XLA:CPU's module has no async pair): compiled once.
    synchronous = _Lowered("HloModule step\n\nENTRY %main () -> f32[] {\n}\n")
    compile_with_latencies(synchronous, {0: 1e-4})
    assert synchronous.options == [None]


def test_both_compiles_take_the_pinnings_options():
    lowered = _Lowered(COMPILED)
    compile_with_latencies(lowered, {0: 1e-4}, {"xla_option": 3})
    assert lowered.options[0] == {"xla_option": 3}
    assert lowered.options[1]["xla_option"] == 3 and PROFILE_OPTION in lowered.options[1]
