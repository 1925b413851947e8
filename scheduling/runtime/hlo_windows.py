"""Did the compiler keep the schedule? The scheduled windows, read back from optimized HLO.

Each pinned window is traced with one frontend attribute naming it: its collective's
start, the computation placed in it, and its done (``_scheduled_window``, beside the
barriers of :mod:`scheduling.runtime.xla_barriers`), or its start, done and products
(``_scheduling_group_id``, :mod:`scheduling.runtime.xla_groups`). XLA:GPU drops a
collective's frontend attributes when it turns JAX's custom calls for the async halves
into its own async start and done (jax 0.11.2 and 0.12), and keeps their ``op_name``: so
the start and done are also traced under a name scope that names the window
(:func:`window_scope`), which is read as the attribute is. In a scheduled HLO
module (XLA:GPU with the latency-hiding scheduler) the entry computation lists its
instructions in execution order, each with the frontend attributes it kept. A window
survived when its start comes before every other instruction carrying its number and its
done after them, with at least one computation between (otherwise XLA ran the collective
synchronously).

:func:`async_pairs` reads every async collective of the module, grouped or not: which
compute instructions the compiled order runs between its start and its done;
:func:`kept_windows` sums both up against the groups the compiler was handed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from scheduling.runtime.xla_barriers import WINDOW_ATTRIBUTE
from scheduling.runtime.xla_groups import GROUP_ATTRIBUTE

_GROUP = re.compile(rf'(?:{GROUP_ATTRIBUTE}|{WINDOW_ATTRIBUTE})="?(\d+)"?')
# A window's scope as one component of an op_name's name stack.
_SCOPE = re.compile(rf"(?:^|/)(?:{GROUP_ATTRIBUTE}|{WINDOW_ATTRIBUTE})=\d+(?=/|$)")
# name = shape opcode(operands...: the shape is one array type or a tuple, which nests.
_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s+([\w\-]+)\(")
_TOKEN = re.compile(r"[\w.\-]+")
_START = re.compile(r"-start$")
_DONE = re.compile(r"-done$")
# Instructions that compute nothing on the device (views, tuples, parameters).
_BOOKKEEPING = frozenset(
    {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "copy"}
)


def window_scope(attribute: str, mark: int) -> str:
    """The name scope a window's start and done are traced under (``attribute=mark``)."""
    return f"{attribute}={mark}"


def without_window_scope(name_stack: str) -> str:
    """``name_stack`` (a path of scopes) without a window's scope: the op's own stack."""
    return _SCOPE.sub("", name_stack).lstrip("/")


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

    @property
    def why(self) -> str:
        """Why the window is not kept, in words ('' when it is)."""
        if self.start is None or self.done is None:
            return "no async start and done: run synchronously, or combined with another"
        if not self.inside:
            return "nothing inside"
        early = sum(position < self.start for position in self.inside)
        late = sum(position > self.done for position in self.inside)
        reasons = [f"{early} of {len(self.inside)} before its start"] if early else []
        reasons += [f"{late} of {len(self.inside)} after its done"] if late else []
        return ", ".join(reasons)

    @property
    def placed(self) -> int:
        """Its instructions the compiled order runs between its start and its done."""
        if self.start is None or self.done is None:
            return 0
        return sum(self.start < position < self.done for position in self.inside)


@dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    rest: str  # the line after the opcode's opening parenthesis: operands, attributes


def parse_instruction(line: str) -> Instruction | None:
    """``name = shape opcode(...)``, or None for a line that is no instruction."""
    head = _HEAD.match(line)
    if head is None:
        return None
    end, depth = head.end(), 0
    # The shape ends at the first blank outside parentheses (a tuple shape nests).
    while end < len(line) and (depth or not line[end].isspace()):
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        end += 1
    opcode = _OPCODE.match(line, end)
    if opcode is None:
        return None
    return Instruction(head.group(1), opcode.group(1), line[opcode.end() :])


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
        instruction = parse_instruction(line)
        if group is None or instruction is None or instruction.opcode in _BOOKKEEPING:
            continue
        window = found.setdefault(int(group.group(1)), Window(int(group.group(1))))
        opcode = instruction.opcode
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


@dataclass(frozen=True)
class AsyncPair:
    """An async collective of the compiled module and what runs inside its window."""

    name: str  # the start instruction's name
    kind: str  # e.g. all-to-all, all-reduce, all-gather, collective-permute
    start: int
    done: int
    between: int  # compute instructions the order runs between start and done

    @property
    def overlapped(self) -> bool:
        return self.between > 0


def async_pairs(hlo_text: str) -> list[AsyncPair]:
    """Every async start/done pair of the entry computation, in start order."""
    starts: dict[str, tuple[int, str]] = {}
    pairs = []
    computing = [0]  # computing[i]: compute instructions before position i
    for position, line in enumerate(entry_instructions(hlo_text)):
        instruction = parse_instruction(line)
        opcode = instruction.opcode if instruction else ""
        is_start, is_done = bool(_START.search(opcode)), bool(_DONE.search(opcode))
        computes = instruction is not None and not (is_start or is_done)
        computing.append(computing[-1] + (computes and opcode not in _BOOKKEEPING))
        if is_start:
            starts[instruction.name] = (position, _kind(opcode, line))
        elif is_done:
            operand = next((t for t in _TOKEN.findall(instruction.rest) if t in starts), None)
            if operand is not None:
                start, kind = starts.pop(operand)
                between = computing[position] - computing[start + 1]
                pairs.append(AsyncPair(operand, kind, start, position, between))
    return sorted(pairs, key=lambda pair: pair.start)


def _kind(opcode: str, line: str) -> str:
    if opcode != "async-start":
        return opcode.removesuffix("-start")
    for kind in ("all-to-all", "reduce-scatter", "all-gather", "all-reduce"):
        if kind in line:
            return kind
    return "async"


@dataclass(frozen=True)
class KeptWindows:
    """What a compiled module kept of the windows its program was emitted with."""

    emitted: int  # scheduling groups in the module handed to the compiler
    kept: int  # groups whose start comes first, done last, computation between
    collectives: int  # async collectives of the compiled module
    overlapped: int  # of those, the ones with computation between start and done
    pinned: str = ""  # how the windows were held in place ("pinned by barriers", ...)
    withheld: str | None = None  # why no group was emitted, where the compiler mishandles them
    scheduled: int = 0  # instructions of the marked windows, besides starts and dones
    placed: int = 0  # of those, the ones the compiled order runs inside their window

    def line(self) -> str:
        inside = (
            f"{self.overlapped} of {self.collectives} async collectives have computation inside"
        )
        if self.withheld:
            return f"scheduled windows not emitted as scheduling groups ({self.withheld}); {inside}"
        text = (
            f"XLA kept {self.kept} of {self.emitted} scheduled windows ({self.pinned}), "
            f"{self.placed} of their {self.scheduled} instructions inside; {inside}"
        )
        if self.emitted and not self.kept:
            text += ": the compiled order is the compiler's own, not the schedule"
        return text


def kept_windows(
    emitted: int, compiled_text: str, pinned: str = "", withheld: str | None = None
) -> KeptWindows:
    """The ``emitted`` windows of a program (marked with their numbers, ``pinned`` as
    that says) as its optimized module ``compiled_text`` runs them (on XLA:GPU, in its
    scheduled order); ``withheld``: why the program was emitted without them."""
    pairs = async_pairs(compiled_text)
    found = windows(compiled_text).values()
    return KeptWindows(
        emitted=emitted,
        kept=sum(window.kept for window in found),
        collectives=len(pairs),
        overlapped=sum(pair.overlapped for pair in pairs),
        pinned=pinned,
        withheld=withheld,
        scheduled=sum(len(window.inside) for window in found),
        placed=sum(window.placed for window in found),
    )
