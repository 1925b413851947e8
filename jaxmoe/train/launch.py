"""``jaxmoe launch``: start N processes of one run on this machine, for testing.

Each process runs ``python -m jaxmoe.train.cli <args> --coordinator ...
--num-processes N --process-id i``; their output is forwarded line by line
with a ``[host i]`` prefix. The emulated cluster reuses :func:`launch` with a
``wrap`` that runs each process inside its own network namespace.

When a process exits non-zero, the run is lost: the launcher names that
process in one line, stops showing the others' output (a survivor's abort
is a long C++ stack dump that says nothing more), and ends them at once:
SIGTERM, then SIGKILL after ``stop_timeout_s``. It returns 1.

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
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

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


class _Processes:
    """The running processes, their output, and the first one to fail."""

    def __init__(self, output: TextIO):
        self.output = output
        self.processes: list[subprocess.Popen] = []
        self.forwarders: list[threading.Thread] = []
        self.failure: tuple[int, int] | None = None
        self._lock = threading.Lock()

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

    def write(self, line: str) -> None:
        with self._lock:
            self.output.write(line)
            self.output.flush()

    def find_failure(self) -> tuple[int, int] | None:
        """The first process seen to exit non-zero, as ``(index, returncode)``."""
        with self._lock:
            if self.failure is None:
                for index, process in enumerate(self.processes):
                    returncode = _peek_returncode(process)
                    if returncode:
                        self.failure = (index, returncode)
                        break
            return self.failure

    def _forward(self, index: int, process: subprocess.Popen) -> None:
        prefix = f"[host {index}] "
        for line in iter(process.stdout.readline, ""):
            # Once another process failed, this one's output is the fallout, not the cause.
            # Checked per line: a survivor's error can arrive before the launcher's next look.
            failure = self.find_failure()
            if failure is None or failure[0] == index:
                self.write(prefix + line)
        process.stdout.close()

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
    module: str = "jaxmoe.train.cli",
    resume_hint: str | None = None,
) -> int:
    """Run ``python -m <module> <command_args>`` as ``num_processes`` processes.

    Returns 0 if all succeed, 1 if one failed (named in a line that ends with
    ``resume_hint`` when given), and the processes' exit status when a signal passed on
    to them ended the run. ``module`` must accept ``--coordinator``,
    ``--num-processes`` and ``--process-id`` as ``jaxmoe train`` does.
    """
    port = free_port(coordinator_host) if port is None else port
    processes = _Processes(sys.stdout if output is None else output)
    with _passing_on_signals(processes) as signals_received:
        try:
            for index in range(num_processes):
                argv = [sys.executable, "-u", "-m", module, *command_args]
                argv += ["--coordinator", f"{coordinator_host}:{port}"]
                argv += ["--num-processes", str(num_processes), "--process-id", str(index)]
                processes.start(wrap(index, argv))
            # After a signal passed on, a failure is no reason to stop the others: they save.
            while processes.running() and (signals_received or not processes.find_failure()):
                time.sleep(0.1)
        except BaseException:
            processes.stop(stop_timeout_s)
            raise
    failure = processes.find_failure()
    if failure is not None and not signals_received:
        index, returncode = failure
        processes.forwarders[index].join(timeout=2)  # its last words come before ours
        others = sum(p.poll() is None for p in processes.processes)
        processes.write(failure_message(index, returncode, others, resume_hint) + "\n")
    processes.stop(stop_timeout_s)
    for forwarder in processes.forwarders:
        forwarder.join(timeout=5)
    if failure is None:
        return 0
    if signals_received:
        returncode = failure[1]
        return returncode if returncode > 0 else 128 - returncode  # the shell's convention
    return 1
