"""``jaxmoe launch``: start N processes of one run on this machine, for testing.

Each process runs ``python -m jaxmoe.train.cli <args> --coordinator ...
--num-processes N --process-id i``; their output is forwarded line by line
with a ``[host i]`` prefix. When a process fails, the launcher says which and
with what status, gives the others ``grace_s`` seconds to stop on their own
(their step watchdog and heartbeat bound that), then ends them, and returns
non-zero. The emulated cluster reuses :func:`launch` with a ``wrap`` that runs
each process inside its own network namespace.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

LAUNCH_FAILURE_MESSAGE = "jaxmoe launch: process {index} failed with exit status {status}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _forward(stream, prefix: str, sink) -> None:
    for line in iter(stream.readline, ""):
        sink.write(f"{prefix}{line}")
        sink.flush()
    stream.close()


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


def launch(
    command_args: Sequence[str],
    num_processes: int,
    *,
    coordinator_host: str = "127.0.0.1",
    port: int | None = None,
    wrap: Callable[[int, list[str]], list[str]] = lambda index, argv: argv,
    grace_s: float = 60.0,
    output=None,
    module: str = "jaxmoe.train.cli",
) -> int:
    """Run ``python -m <module> <command_args>`` as ``num_processes`` processes.

    Returns 0 if all succeed. ``module`` must accept ``--coordinator``,
    ``--num-processes`` and ``--process-id`` as ``jaxmoe train`` does.
    """
    output = sys.stdout if output is None else output
    port = free_port(coordinator_host) if port is None else port
    processes: list[subprocess.Popen] = []
    forwarders: list[threading.Thread] = []
    for index in range(num_processes):
        argv = [sys.executable, "-u", "-m", module, *command_args]
        argv += ["--coordinator", f"{coordinator_host}:{port}"]
        argv += ["--num-processes", str(num_processes), "--process-id", str(index)]
        process = subprocess.Popen(
            wrap(index, argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_environment(),
        )
        processes.append(process)
        forwarder = threading.Thread(
            target=_forward, args=(process.stdout, f"[host {index}] ", output), daemon=True
        )
        forwarder.start()
        forwarders.append(forwarder)

    failure: tuple[int, int] | None = None
    try:
        while any(p.poll() is None for p in processes):
            for index, process in enumerate(processes):
                status = process.poll()
                if status not in (None, 0) and failure is None:
                    failure = (index, status)
                    output.write(
                        LAUNCH_FAILURE_MESSAGE.format(index=index, status=status)
                        + f"; stopping the others within {grace_s:.0f} s\n"
                    )
                    output.flush()
            if failure is not None:
                _stop(processes, grace_s)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(processes, 0.0)
        raise
    for forwarder in forwarders:
        forwarder.join(timeout=5)
    if failure is None:
        failed = [(i, p.returncode) for i, p in enumerate(processes) if p.returncode != 0]
        if failed:
            failure = failed[0]
            output.write(LAUNCH_FAILURE_MESSAGE.format(index=failure[0], status=failure[1]) + "\n")
    return 0 if failure is None else 1


def _stop(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the processes to end, then terminate, then kill."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
