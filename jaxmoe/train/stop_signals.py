"""Preemption: SIGTERM or SIGINT ends a run at a step boundary, after a checkpoint.

Clusters preempt a job with SIGTERM (SLURM, Kubernetes) and people stop one with
Ctrl-C (SIGINT). The first such signal asks the loop to finish the step it is in,
write a checkpoint and exit with ``exit_codes.PREEMPTED``; a second one ends the
process at once (status 128 + the signal's number, as the shell reports a death by
signal).

In a multi-process run every process must stop after the same step, or the ones
still training would wait forever in the next step's collectives. JAX's
preemption service agrees on that step: when any process gets SIGTERM, the
coordination service collects every process's step and picks the next one after
the largest (``multihost_utils.reached_preemption_sync_point``). Its SIGTERM
handler is installed by ``jax.distributed.initialize``, so here SIGTERM is left to
it and SIGINT is passed on to it as a SIGTERM to this process. That handler takes
one notice and ignores the rest, so in a multi-process run a second SIGTERM ends the
process at once only from the agreed step on (a step or two after the first); a
second SIGINT always does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import jax
from jax.experimental import multihost_utils


class StopSignals:
    """Within ``with``: SIGINT (and SIGTERM in a single process) request a clean stop."""

    def __init__(self) -> None:
        self.multi_process = jax.process_count() > 1
        self.received: int | None = None  # the first signal's number
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self._install(signal.SIGINT)
        if not self.multi_process:
            self._install(signal.SIGTERM)
        return self

    def _install(self, number: int) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous.setdefault(number, signal.signal(number, self._handle))

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            # None: the previous handler was not Python's (JAX's C++ one); it cannot return.
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        if self.received is not None:
            print(f"jaxmoe: {name} again: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + number)
        self.received = number
        print(
            f"jaxmoe: {name}: finishing this step and writing a checkpoint "
            f"(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )
        if self.multi_process:
            os.kill(os.getpid(), signal.SIGTERM)  # into JAX's preemption service

    def stop_after(self, steps_done: int) -> bool:
        """Whether to stop now that ``steps_done`` steps are done; call once per step.

        In a multi-process run this is the preemption service's verdict, the same on
        every process (all of them must call it at every step).
        """
        if not self.multi_process:
            return self.received is not None
        agreed = multihost_utils.reached_preemption_sync_point(steps_done)
        if agreed and self.received is None:
            # The notice went to JAX's handler; from here on another SIGTERM exits at once.
            self.received = signal.SIGTERM
            self._install(signal.SIGTERM)
        return agreed
