"""Did the compiler keep the plan? The planned windows, read back from optimized HLO.

Each critical window is emitted under one ``_scheduling_group_id``
(:mod:`scheduling.runtime.emit`): its collective's start, the computation placed in it,
and its done. In a scheduled HLO module (XLA:GPU with the latency-hiding scheduler) the
entry computation lists its instructions in execution order, each with the frontend
attributes it was traced under. A window survived when its start comes before every
other instruction of its group and its done after them, with at least one computation
between (otherwise XLA ran the collective synchronously).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_GROUP = re.compile(r'_scheduling_group_id="?(\d+)"?')
# name = shape (a tuple in parentheses, or one array type) opcode(...
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\([^)]*\)|\S+)\s+([\w\-]+)\(")
_START = re.compile(r"-start$")
_DONE = re.compile(r"-done$")


@dataclass
class Window:
    """One scheduling group as the compiled module orders it."""

    group: int
    start: int | None = None  # position of the collective's start in the entry computation
    done: int | None = None
    inside: list[int] = field(default_factory=list)  # positions of its other instructions

    @property
    def kept(self) -> bool:
        """The start comes first, the done last, computation between them."""
        if self.start is None or self.done is None or not self.inside:
            return False
        return self.start < min(self.inside) and max(self.inside) < self.done


def entry_instructions(hlo_text: str) -> list[str]:
    """The instruction lines of the module's ENTRY computation, in order."""
    lines, inside = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            lines.append(line)
    return lines


def windows(hlo_text: str) -> dict[int, Window]:
    """Every scheduling group of the entry computation, with its positions."""
    found: dict[int, Window] = {}
    for position, line in enumerate(entry_instructions(hlo_text)):
        group = _GROUP.search(line)
        match = _INSTRUCTION.match(line)
        if group is None or match is None:
            continue
        window = found.setdefault(int(group.group(1)), Window(int(group.group(1))))
        opcode = match.group(2)
        if _START.search(opcode):
            window.start = position
        elif _DONE.search(opcode):
            window.done = position
        else:
            window.inside.append(position)
    return found


def broken_windows(hlo_text: str) -> list[Window]:
    """The windows the compiler did not keep."""
    return [window for window in windows(hlo_text).values() if not window.kept]
