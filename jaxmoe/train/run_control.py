"""How a run ends early: stop signals, and a watchdog for steps that hang.

**Stop signals.** SIGTERM or SIGINT end a run promptly at every stage.

Clusters preempt a job with SIGTERM (SLURM, Kubernetes) and people stop one with
Ctrl-C (SIGINT). What a signal does depends on where the run is:

- **starting** (JAX's import, the distributed runtime, planning, the initial state,
  compilation): nothing is worth keeping yet, so the process says so in one line and
  exits at once with ``exit_codes.PREEMPTED``, having written no checkpoint. ``jaxmoe
  train`` installs the handlers before it imports JAX (a signal inside the import of its
  extension modules would otherwise abort the process). Long start-up work
  (compilation) runs through :meth:`StopSignals.interruptible`, so that the signal is
  acted on while XLA compiles rather than after.
- **training**: the first signal asks the loop to finish the step it is in, write a
  checkpoint and exit with ``exit_codes.PREEMPTED``; a second one ends the process at
  once (status 128 + the signal's number, as the shell reports a death by signal).

In a multi-process run every process must stop after the same step, or the ones
still training would wait forever in the next step's collectives. JAX's preemption
service agrees on that step: when any process gets SIGTERM, the coordination service
collects every process's step and picks the next one after the largest
(``multihost_utils.reached_preemption_sync_point``). Its SIGTERM handler is installed by
``jax.distributed.initialize``, so once training there SIGTERM is left to it and SIGINT
is passed on to it as a SIGTERM to this process. That handler takes one notice and
ignores the rest, so a second SIGTERM ends the process at once only from the agreed
step on (a step or two after the first); a second SIGINT always does. A SIGTERM that
reaches a multi-process run after ``jax.distributed.initialize`` but before the first
step is that service's too: the run stops after its first step, with a checkpoint.

**The step watchdog.** A process whose peer died must not hang in a collective forever.
Each training step (and each validation pass) runs inside ``watchdog.step(n)``. If one
takes longer than the timeout, the watchdog prints
:data:`~jaxmoe.parallel.distributed.PEER_FAILURE_MESSAGE` and ends the process with
:data:`~jaxmoe.parallel.distributed.PEER_FAILURE_EXIT_CODE`: a thread blocked inside XLA
cannot be interrupted, so ``os._exit`` is the only bound.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

from jaxmoe import exit_codes
from jaxmoe.parallel.distributed import PEER_FAILURE_EXIT_CODE, PEER_FAILURE_MESSAGE

Result = TypeVar("Result")
_POLL_S = 0.1


class StopSignals:
    """Within ``with``: SIGINT (and SIGTERM, but where JAX's preemption service owns it)
    stop the run; see the module docstring. ``multi_process``: the run spans processes."""

    def __init__(self, multi_process: bool = False) -> None:
        self.multi_process = multi_process
        self.received: int | None = None  # the first signal's number, once training
        self.training = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        self._install(signal.SIGINT)
        # Before jax.distributed.initialize this handler has SIGTERM; initialize replaces it
        # with the preemption service's in a multi-process run.
        self._install(signal.SIGTERM)
        return self

    def _install(self, number: int) -> None:
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(number, self._handle)
            self._previous.setdefault(number, previous)

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            # None: the previous handler was not Python's (JAX's C++ one); it cannot return.
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        if not self.training:
            print(
                f"jaxmoe: {name} while starting: stopped before the first step, no "
                "checkpoint written",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(exit_codes.PREEMPTED)
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

    def start_training(self) -> None:
        """From here on a signal stops the run after the step in flight, with a checkpoint.

        In a multi-process run SIGTERM belongs to JAX's preemption service from here on."""
        self.training = True
        if self.multi_process:
            self._previous.pop(signal.SIGTERM, None)

    def interruptible(self, work: Callable[[], Result]) -> Result:
        """``work()``, run so that a signal is acted on while it runs (compilation holds the
        main thread in C++, where Python's signal handlers wait); its result or error."""
        if threading.current_thread() is not threading.main_thread():
            return work()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = work()
            except BaseException as error:  # handed to the caller below
                outcome["error"] = error

        worker = threading.Thread(target=run, name="jaxmoe-start-up", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(_POLL_S)  # returns to Python often: the handlers run meanwhile
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def stop_after(self, steps_done: int) -> bool:
        """Whether to stop now that ``steps_done`` steps are done; call once per step.

        In a multi-process run this is the preemption service's verdict, the same on
        every process (all of them must call it at every step).
        """
        if not self.multi_process:
            return self.received is not None
        from jax.experimental import multihost_utils

        agreed = multihost_utils.reached_preemption_sync_point(steps_done)
        if agreed and self.received is None:
            # The notice went to JAX's handler; from here on another SIGTERM exits at once.
            self.received = signal.SIGTERM
            self._install(signal.SIGTERM)
        return agreed


class StepWatchdog:
    """Ends the process when a step runs past ``timeout_s`` (None: never); see the module
    docstring."""

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
