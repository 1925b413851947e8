"""A step watchdog: a process whose peer died must not hang in a collective forever.

Each training step (and each validation pass) runs inside ``watchdog.step(n)``.
If one takes longer than the timeout, the watchdog prints
:data:`~jaxmoe.parallel.distributed.PEER_FAILURE_MESSAGE` and ends the process
with :data:`~jaxmoe.parallel.distributed.PEER_FAILURE_EXIT_CODE`: a thread
blocked inside XLA cannot be interrupted, so ``os._exit`` is the only bound.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

from jaxmoe.parallel.distributed import PEER_FAILURE_EXIT_CODE, PEER_FAILURE_MESSAGE


class StepWatchdog:
    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self._deadline: float | None = None
        self._step = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StepWatchdog:
        if self.timeout_s is not None:
            self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @contextlib.contextmanager
    def step(self, index: int) -> Iterator[None]:
        with self._lock:
            self._step = index
            self._deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
                step = self._step
            if expired:
                print(
                    PEER_FAILURE_MESSAGE.format(step=step, timeout=self.timeout_s),
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(PEER_FAILURE_EXIT_CODE)
