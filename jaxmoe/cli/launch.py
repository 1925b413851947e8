"""``jaxmoe launch``: start N processes of one run on this machine, for testing.

Each process runs ``python -m jaxmoe.cli <args> --coordinator ...
--num-processes N --process-id i``; their output is forwarded line by line
with a ``[host i]`` prefix. The emulated cluster reuses :func:`launch` with a
``wrap`` that runs each process inside its own network namespace.

When a process exits non-zero, the run is lost: the launcher names that
process in one line, stops showing the others' output (a survivor's abort
is a long C++ stack dump that says nothing more), and ends them at once:
SIGTERM, then SIGKILL after ``stop_timeout_s``. It returns 1. Output is
shown ``hold_s`` late, so that a survivor's first lines, which can come
before the launcher sees the death, are dropped too; and a process that
only reacted to a dead peer (:func:`is_peer_reaction`) is not the one named.

The processes run in their own session, so a Ctrl-C at the terminal reaches
the launcher alone; it passes SIGINT and SIGTERM on to every process, once
per signal received, and waits for them to finish (a training process saves
and exits on the first, and exits at once on the second; a third signal
sends SIGKILL). It then returns the first non-zero exit status among them
(128 + N for signal N).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TextIO

from jaxmoe.exit_codes import PEER_FAILURE, PREEMPTED

PASSED_ON_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def child_environment() -> dict[str, str]:
    """This environment without a forced host-device count: each child sets its own share."""
    env = dict(os.environ)
    flags = [
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def describe_exit(returncode: int) -> str:
    """``failed with exit status 3``, or ``was killed by SIGKILL`` for a signal."""
    if returncode >= 0:
        return f"failed with exit status {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def failure_message(index: int, returncode: int, others: int, resume_hint: str | None) -> str:
    """The launcher's one line about a failed process."""
    line = f"jaxmoe launch: process {index} {describe_exit(returncode)}"
    if others:
        them = "the other process" if others == 1 else f"the other {others} processes"
        line += f"; stopping {them} (their further output is not shown)"
    return line + (f"; {resume_hint}" if resume_hint else "")


def _peek_returncode(process: subprocess.Popen) -> int | None:
    """The exit status, without reaping the process: any thread may ask at any time."""
    if process.returncode is not None or not hasattr(os, "waitid"):
        return process.returncode
    try:
        exited = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped by poll() meanwhile
        return process.returncode
    if exited is None:
        return None
    return exited.si_status if exited.si_code == os.CLD_EXITED else -exited.si_status


def is_peer_reaction(returncode: int) -> bool:
    """How a process ends when a peer died (see jaxmoe.parallel.distributed): gloo and the
    coordination service abort (SIGABRT, 134 through a shell), the step watchdog exits 3."""
    return returncode in (-signal.SIGABRT, 128 + signal.SIGABRT, PEER_FAILURE)


class _Processes:
    """The running processes, their output, and the one that failed first.

    A survivor reacts to a dead peer within milliseconds, sometimes before the launcher
    sees the death. So each line of output is held for ``hold_s`` before it is shown;
    once a failure is seen, held lines wait until the launcher has named the failed
    process, and only that process's lines are shown.
    """

    def __init__(self, output: TextIO, hold_s: float):
        self.output = output
        self.hold_s = hold_s
        self.processes: list[subprocess.Popen] = []
        self.forwarders: list[threading.Thread] = []
        self.failed: list[tuple[int, int]] = []  # (index, returncode), in the order seen
        self.named: int | None = None
        self.signalled = False  # a signal was passed on: show every process's output
        self._lock = threading.Lock()
        self._failure_named = threading.Event()
        # (arrival time, process index, line), or a flush marker (0, -1, event to set).
        self._lines: queue.Queue[tuple[float, int, str | threading.Event]] = queue.Queue()
        threading.Thread(target=self._show_lines, daemon=True).start()

    def start(self, argv: list[str]) -> None:
        index = len(self.processes)
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_environment(),
            start_new_session=True,
        )
        self.processes.append(process)
        forwarder = threading.Thread(target=self._forward, args=(index, process), daemon=True)
        forwarder.start()
        self.forwarders.append(forwarder)

    def _forward(self, index: int, process: subprocess.Popen) -> None:
        for line in iter(process.stdout.readline, ""):
            self._lines.put((time.monotonic(), index, line))
        process.stdout.close()

    def _show_lines(self) -> None:
        while True:
            arrived, index, line = self._lines.get()
            if isinstance(line, threading.Event):
                line.set()
                continue
            time.sleep(max(0.0, arrived + self.hold_s - time.monotonic()))
            if not self.signalled and self.see_failures():
                self._failure_named.wait()
            if self.signalled or self.named is None or self.named == index:
                self.write(f"[host {index}] {line}")

    def write(self, text: str) -> None:
        with self._lock:
            self.output.write(text)
            self.output.flush()

    def see_failures(self) -> list[tuple[int, int]]:
        """Record every process that has exited non-zero since the last look."""
        with self._lock:
            for index, process in enumerate(self.processes):
                returncode = _peek_returncode(process)
                stopped_cleanly = returncode == PREEMPTED  # saved; the others too
                if returncode and not stopped_cleanly and index not in (i for i, _ in self.failed):
                    self.failed.append((index, returncode))
            return self.failed

    def show_everything(self) -> None:
        """After a signal passed on, every process's output counts: none is filtered."""
        self.signalled = True
        self._failure_named.set()

    def name_failure(self) -> tuple[int, int]:
        """The failed process to blame: the first seen that did not just react to a peer."""
        index, returncode = next(
            (fail for fail in self.failed if not is_peer_reaction(fail[1])), self.failed[0]
        )
        self.named = index
        self._failure_named.set()
        return index, returncode

    def flush(self, indices: Iterable[int]) -> None:
        """Show (or drop) every line received so far, those of ``indices`` to their end."""
        for index in indices:
            self.forwarders[index].join(timeout=2)
        reached = threading.Event()
        self._lines.put((0.0, -1, reached))
        reached.wait()

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def signal_running(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to every running process, SIGKILL to those still running after the bound."""
        self.signal_running(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
        for process in self.processes:
            process.wait()


@contextlib.contextmanager
def _passing_on_signals(processes: _Processes) -> Iterator[list[int]]:
    """Within: SIGINT and SIGTERM go to the processes; yields the signals received."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received  # signal handlers can only be set from the main thread
        return

    def pass_on(signum: int, frame: object) -> None:
        received.append(signum)
        processes.show_everything()
        processes.signal_running(signum if len(received) < 3 else signal.SIGKILL)

    previous = {signum: signal.signal(signum, pass_on) for signum in PASSED_ON_SIGNALS}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def launch(
    command_args: Sequence[str],
    num_processes: int,
    *,
    coordinator_host: str = "127.0.0.1",
    port: int | None = None,
    wrap: Callable[[int, list[str]], list[str]] = lambda index, argv: argv,
    stop_timeout_s: float = 3.0,
    output: TextIO | None = None,
    module: str = "jaxmoe.cli",
    resume_hint: str | None = None,
    hold_s: float = 0.3,
) -> int:
    """Run ``python -m <module> <command_args>`` as ``num_processes`` processes.

    Returns 0 if all succeed, 1 if one failed (named in a line that ends with
    ``resume_hint`` when given), and the processes' exit status when a signal passed on
    to them ended the run. Each line of output is shown ``hold_s`` after it arrives.
    ``module`` must accept ``--coordinator``, ``--num-processes`` and ``--process-id``
    as ``jaxmoe train`` does.
    """
    port = free_port(coordinator_host) if port is None else port
    processes = _Processes(sys.stdout if output is None else output, hold_s)
    with _passing_on_signals(processes) as signals_received:
        try:
            for index in range(num_processes):
                argv = [sys.executable, "-u", "-m", module, *command_args]
                argv += ["--coordinator", f"{coordinator_host}:{port}"]
                argv += ["--num-processes", str(num_processes), "--process-id", str(index)]
                processes.start(wrap(index, argv))
            # After a signal passed on, a failure is no reason to stop the others: they save.
            while processes.running() and (signals_received or not processes.see_failures()):
                time.sleep(0.05)
            if processes.see_failures():
                time.sleep(hold_s)  # the others' reactions to it, if any, end meanwhile
                processes.see_failures()
        except BaseException:
            processes.stop(stop_timeout_s)
            raise
    if not processes.failed:
        processes.flush(range(num_processes))
        if any(process.returncode == PREEMPTED for process in processes.processes):
            processes.write(
                "jaxmoe launch: the run stopped on a signal after writing a checkpoint"
                + (f"; {resume_hint}" if resume_hint else "")
                + "\n"
            )
            return PREEMPTED
        return 0
    if signals_received:
        processes.flush(range(num_processes))
        returncode = processes.failed[0][1]
        return returncode if returncode > 0 else 128 - returncode  # the shell's convention
    index, returncode = processes.name_failure()
    processes.flush([index])  # its last words come before ours
    others = sum(p.poll() is None for p in processes.processes)
    processes.write(failure_message(index, returncode, others, resume_hint) + "\n")
    processes.stop(stop_timeout_s)
    processes.flush(range(num_processes))
    return 1
