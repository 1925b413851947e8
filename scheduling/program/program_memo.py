"""``ProgramMemo``: what was computed from the programs seen last, kept by their identity.

A planner prices and walks each traced program several times (every schedule it
estimates, the memory walk's peak, the backward pass's start, the recomputations); what
those derive from a program alone is made once. Programs are not hashable by value, so
an entry holds the program itself and answers only for that same object.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


class ProgramMemo[T]:
    """At most ``kept`` values, each of one program and a key; the oldest make way."""

    def __init__(self, kept: int):
        self.kept = kept
        self._found: dict[tuple[int, Hashable], tuple[Any, T]] = {}

    def get(self, program: Any, key: Hashable, make: Callable[[], T]) -> T:
        """The value of ``program`` and ``key``, made by ``make()`` where none is kept."""
        slot = (id(program), key)
        found = self._found.get(slot)
        if found is None or found[0] is not program:
            while len(self._found) >= self.kept:
                del self._found[next(iter(self._found))]
            found = self._found[slot] = (program, make())
        return found[1]
