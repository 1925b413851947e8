"""A failed checkpoint write said once: what the process silences of Orbax's own reports.

A save that fails (a disk filling up mid-write) reaches the run as one error, which it
reports in one line (:class:`~jaxmoe.train.checkpoint.CheckpointWriteError`). Orbax and
TensorStore report the same failure again, many times, from their threads:

- Orbax logs it through absl, as tracebacks from several threads;
- Orbax awaits a save's TensorStore writes together in an event loop of its own, which it
  closes at the first write that fails, the others still in flight. As each of those
  ends, TensorStore hands its result to the closed loop, and reports the
  ``RuntimeError('Event loop is closed')`` that raises as unraisable: a traceback per
  array (hundreds for one save);
- asyncio logs each write error that was set on a future no one awaited any more
  ("Future exception was never retrieved", and the same of the futures gathering them).

:func:`quiet_failed_saves` drops exactly those three for the rest of the process; every
other unraisable error and asyncio log record passes on as before.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

_LOOP_CLOSED = "Event loop is closed"
# asyncio's report of an error set on a future no one awaits: "<its class> exception ...".
_UNRETRIEVED = " exception was never retrieved"


class _DropResultsForClosedLoops:
    """``sys.unraisablehook``: drops a result handed to a closed event loop, passes on the
    rest to the hook it wraps."""

    def __init__(self, wrapped: Callable[[Any], object]):
        self.wrapped = wrapped

    def __call__(self, unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == _LOOP_CLOSED:
            return
        self.wrapped(unraisable)


class _DropUnretrievedErrors(logging.Filter):
    """The asyncio logger's reports of errors that no one awaited."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().partition("\n")[0].endswith(_UNRETRIEVED)


def quiet_failed_saves() -> None:
    """Leave a failed save to the run's own line (see the module docstring); installed
    once per process, however often it is called."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.FATAL)
    if not isinstance(sys.unraisablehook, _DropResultsForClosedLoops):
        sys.unraisablehook = _DropResultsForClosedLoops(sys.unraisablehook)
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropUnretrievedErrors) for f in asyncio_log.filters):
        asyncio_log.addFilter(_DropUnretrievedErrors())
