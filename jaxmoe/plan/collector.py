"""The garbage collector's pace while the planner traces.

Tracing a step allocates millions of short-lived objects (tracers, equations, avals), and
a plan takes hundreds of traces. At Python's default thresholds the collector examines
the youngest objects every 700 net allocations and, every hundred of those, the whole
heap: JAX, Flax and the traced programs a plan keeps, which none of its collections
free. :func:`collecting_less` runs a function with the heap as it stands set aside
(``gc.freeze``, unless the caller has set objects aside already) and the youngest objects
examined every 50,000 net allocations; both are undone when it returns. Only when objects
are freed changes, not which: the planner computes the same figures.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable

# Allocations between collections of the youngest objects, and how many of those (then of
# the middle generation's) before each older generation's.
THRESHOLDS = (50_000, 20, 100)


def collecting_less[**P, R](function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run with the collector at :data:`THRESHOLDS`, what was alive before
    the call never examined by it (module docstring)."""

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        before = gc.get_threshold()
        freeze = not gc.get_freeze_count()  # else the caller's, left as it is
        if freeze:
            gc.freeze()
        gc.set_threshold(*THRESHOLDS)
        try:
            return function(*args, **kwargs)
        finally:
            gc.set_threshold(*before)
            if freeze:
                gc.unfreeze()

    return run


def collect_less() -> None:
    """This whole process at :data:`THRESHOLDS`, what is alive now set aside: for a process
    that only traces (the planner's workers)."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
