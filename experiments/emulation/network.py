"""Emulate a cluster of H hosts on one Linux machine with network namespaces.

``EmulatedNetwork`` builds a star topology: one network namespace per host and one "switch"
namespace holding a Linux bridge, joined by one veth pair per host::

    <prefix>-<run>-h0   [eth0 10.213.n.1] ---veth--- [h0]  \\
    <prefix>-<run>-h1   [eth0 10.213.n.2] ---veth--- [h1]   br0   <prefix>-<run>-sw
    ...                                                   /

Nothing is added to the root namespace (no interface, address or route), so processes
started in a host namespace (``EmulatedNetwork.command``) can reach only loopback and the
other emulated hosts.

What this module owns, and removes again on exit (also after a failed or interrupted set-up,
and on SIGINT/SIGTERM while the context is active):

* the namespaces ``<prefix>-<run_id>-h<i>`` and ``<prefix>-<run_id>-sw`` (deleting them deletes
  the veths and the bridge inside);
* the directories ``/etc/netns/<prefix>-<run_id>-h<i>`` (and ``/etc/netns`` itself when it
  did not exist and is empty again), each holding a ``hosts`` file that
  ``ip netns exec`` bind-mounts over ``/etc/hosts``, so that inside host i the machine's
  hostname resolves to host i's address (gloo binds to the address the hostname resolves to).

Link shaping (``LinkShape``) models each host's link to the switch:

* ``rate_mbit`` caps both directions: a ``tbf`` qdisc on the egress of the host end (uplink)
  and of the switch end (downlink) of the host's veth pair. Host-to-host traffic therefore
  sees the slower of the sender's uplink and the receiver's downlink, as on a non-blocking
  switch.
* ``delay_ms`` is the one-way delay between any two hosts (the round trip is twice that). It
  is added once per path by a ``netem`` qdisc on the host end's egress only, as the root
  qdisc with the ``tbf`` as its child (the layout the netem documentation gives for
  delay plus rate). It needs a kernel with ``sch_netem``; ``netem_available`` checks.

Needs root and iproute2 (``ip``, ``tc``); ``namespaces_available`` checks.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

NETNS_CONFIG_DIR = Path("/etc/netns")
"""``ip netns exec <ns>`` bind-mounts each file in ``/etc/netns/<ns>/`` over ``/etc/<file>``."""

NETNS_RUN_DIR = Path("/run/netns")
"""Where ``ip netns add`` mounts named namespaces (``/var/run/netns``)."""

SUBNET_PREFIX = "10.213"
"""The emulated hosts use ``10.213.<n>.0/24``, only inside namespaces this module creates."""

HOST_INTERFACE = "eth0"
"""Name of each host's interface inside its namespace (e.g. for ``GLOO_SOCKET_IFNAME``)."""

BRIDGE = "br0"
"""Name of the bridge inside the switch namespace."""

TBF_LATENCY_MS = 50
"""Longest a packet may wait in a ``tbf`` queue before it is dropped (sets the queue size):
far above the round trip between namespaces, so TCP fills the link without drops."""

TBF_MIN_BURST_BYTES = 4096
"""Smallest ``tbf`` bucket: two full-size frames and a little (tbf splits GSO bursts)."""

TBF_BURST_SECONDS = 0.000125
"""Above the minimum, the bucket holds 0.125 ms of line rate. A bucket refills while the
link is idle (during computation) and then lets that much out at memory speed, so it must
be small against a message: a 10 ms bucket let 8 pieces of a 2 MB exchange through at
nearly twice the line rate. A fraction of a millisecond still lets TCP reach line rate on
these hosts up to a few hundred Mbit/s (``experiments.emulation.link_calibration``
measures it)."""

NETEM_LIMIT_PACKETS = 100_000
"""Packets netem may hold while delaying them (its default of 1000 drops at high rates)."""

COMMAND_TIMEOUT_S = 30.0
"""No single ``ip``/``tc`` call should come close to this."""

_MAX_HOSTS = 254
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class LinkShape:
    """How each host's link to the switch is shaped.

    Attributes:
        rate_mbit: bandwidth cap in Mbit/s, in each direction; ``None`` leaves it unshaped.
        delay_ms: one-way delay added between any two hosts, in milliseconds.
    """

    rate_mbit: float | None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not (
            math.isfinite(self.rate_mbit) and self.rate_mbit > 0
        ):
            raise ValueError(
                f"rate_mbit must be a positive, finite number of Mbit/s or None, "
                f"got {self.rate_mbit!r}"
            )
        if not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise ValueError(
                f"delay_ms must be a non-negative, finite number of milliseconds, "
                f"got {self.delay_ms!r}"
            )

    @property
    def bucket_bytes(self) -> int | None:
        """Size of the ``tbf`` bucket that shapes the rate (``None`` when unshaped)."""
        if self.rate_mbit is None:
            return None
        return max(TBF_MIN_BURST_BYTES, round(self.rate_mbit * 1e6 / 8 * TBF_BURST_SECONDS))

    def tc_commands(self, namespace: str, device: str, *, with_delay: bool) -> list[list[str]]:
        """The ``tc`` commands that shape egress of ``device`` in ``namespace``.

        ``with_delay`` adds the netem delay (used on the host end of each link only). Returns
        no command when there is nothing to shape.
        """
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        delay = with_delay and self.delay_ms > 0
        commands: list[list[str]] = []
        if delay:
            delay_us = max(1, round(self.delay_ms * 1000))
            commands.append(
                [
                    *tc,
                    *("root", "handle", "1:", "netem"),
                    *("delay", f"{delay_us}us", "limit", str(NETEM_LIMIT_PACKETS)),
                ]
            )
        if self.rate_mbit is not None:
            rate_bit = max(1, round(self.rate_mbit * 1_000_000))
            parent = ("parent", "1:1", "handle", "10:") if delay else ("root", "handle", "10:")
            commands.append(
                [
                    *tc,
                    *parent,
                    *("tbf", "rate", f"{rate_bit}bit", "burst", str(self.bucket_bytes)),
                    *("latency", f"{TBF_LATENCY_MS}ms"),
                ]
            )
        return commands


def run_command(argv: Sequence[str]) -> str:
    """Run ``argv`` (an ``ip``/``tc`` call) and return its stdout.

    Raises:
        RuntimeError: naming the command and its stderr when it fails, is missing or hangs.
    """
    argv = list(argv)
    command = shlex.join(argv)
    try:
        completed = subprocess.run(
            argv, check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except subprocess.CalledProcessError as error:
        stderr = (error.stderr or "").strip() or "(no stderr)"
        raise RuntimeError(
            f"command failed (exit {error.returncode}): {command}: {stderr}"
        ) from error
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"command timed out after {error.timeout} s: {command}") from error
    except OSError as error:
        raise RuntimeError(f"command could not be started: {command}: {error}") from error
    return completed.stdout


def namespace_exists(name: str) -> bool:
    """Whether a named network namespace ``name`` exists (as ``ip netns list`` would show)."""
    return (NETNS_RUN_DIR / name).exists()


def namespaces_available() -> tuple[bool, str]:
    """Whether this process can create network namespaces, and why not.

    Creates and deletes a throwaway namespace. Returns ``(True, "...")`` or ``(False, reason)``
    when not root, iproute2 is missing, or the kernel refuses.
    """
    if os.geteuid() != 0:
        return False, f"not running as root (euid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"iproute2 is not installed: {', '.join(missing)} not found on PATH"
    probe = f"jaxmoe-probe-{secrets.token_hex(4)}"
    try:
        run_command(["ip", "netns", "add", probe])
    except RuntimeError as error:
        return False, f"cannot create a network namespace: {error}"
    try:
        run_command(["ip", "netns", "delete", probe])
    except RuntimeError as error:
        return False, f"created but could not delete the probe namespace {probe}: {error}"
    return True, "network namespaces can be created"


def netem_available() -> tuple[bool, str]:
    """Whether the kernel has the ``netem`` qdisc (needed for ``LinkShape.delay_ms > 0``).

    Adds netem to ``lo`` of a throwaway namespace, then deletes the namespace.
    """
    available, reason = namespaces_available()
    if not available:
        return False, reason
    probe = f"jaxmoe-probe-{secrets.token_hex(4)}"
    run_command(["ip", "netns", "add", probe])
    try:
        run_command(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        )
    except RuntimeError as error:
        return False, f"the kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): {error}"
    finally:
        run_command(["ip", "netns", "delete", probe])
    return True, "netem qdisc available"


class EmulatedNetwork:
    """H emulated hosts behind one switch, each in its own network namespace.

    Use as a context manager; the namespaces exist only inside the ``with`` block::

        with EmulatedNetwork(2, LinkShape(rate_mbit=100, delay_ms=1)) as net:
            server = subprocess.Popen(net.command(1, ["python", "server.py"]))
            subprocess.run(net.command(0, ["python", "client.py", net.host_addresses[1]]))

    A fresh random ``run_id`` per instance keeps parallel runs apart; the subnet octet is
    derived from it too. While the context is active, SIGINT and SIGTERM first tear the
    network down, then go on to the handlers that were installed before (only when entered
    from the main thread; Python delivers signals there only).
    """

    def __init__(self, hosts: int, link: LinkShape, prefix: str = "jaxmoe") -> None:
        if not 1 <= hosts <= _MAX_HOSTS:
            raise ValueError(f"hosts must be between 1 and {_MAX_HOSTS}, got {hosts!r}")
        if not prefix or not all(c.isalnum() or c in "-_" for c in prefix):
            raise ValueError(f"prefix must be non-empty letters, digits, '-' or '_': {prefix!r}")
        self.hosts = hosts
        self.link = link
        self.prefix = prefix
        self.run_id = secrets.token_hex(3)
        self.subnet = f"{SUBNET_PREFIX}.{int(self.run_id, 16) % 256}"
        self._created_namespaces: list[str] = []
        self._created_config_dirs: list[Path] = []
        self._created_config_root = False
        self._previous_handlers: dict[int, Any] = {}
        self._active = False

    @property
    def namespaces(self) -> list[str]:
        """Host namespace names, host i at index i."""
        return [f"{self.prefix}-{self.run_id}-h{i}" for i in range(self.hosts)]

    @property
    def switch_namespace(self) -> str:
        """Name of the namespace holding the bridge."""
        return f"{self.prefix}-{self.run_id}-sw"

    @property
    def host_addresses(self) -> list[str]:
        """IPv4 address of each host (on ``HOST_INTERFACE``, prefix length 24)."""
        return [f"{self.subnet}.{i + 1}" for i in range(self.hosts)]

    @property
    def config_dirs(self) -> list[Path]:
        """The ``/etc/netns/<ns>`` directory of each host."""
        return [NETNS_CONFIG_DIR / name for name in self.namespaces]

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i``'s namespace."""
        if not 0 <= i < self.hosts:
            raise IndexError(f"host index {i} out of range for {self.hosts} hosts")
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> EmulatedNetwork:
        if self._active:
            raise RuntimeError("EmulatedNetwork is already active; it cannot be nested")
        available, reason = namespaces_available()
        if not available:
            raise PermissionError(
                "emulated cluster needs root and iproute2 to create network namespaces: " + reason
            )
        self._active = True
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close(raise_on_failure=False)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(raise_on_failure=exc is None)

    def close(self, raise_on_failure: bool = True) -> None:
        """Remove everything this network created; safe to call any number of times.

        Tries every removal even if some fail; then raises ``RuntimeError`` listing the
        failures (or only warns, with ``raise_on_failure=False``). Processes still running in
        a host namespace are not killed: the namespace loses its name at once but lives on,
        unreachable, until they exit; stop them before leaving the ``with`` block.
        """
        failures = self._teardown()
        self._restore_signal_handlers()
        self._active = False
        if failures:
            message = "could not remove all of the emulated network: " + "; ".join(failures)
            if raise_on_failure:
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    # -- building ----------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        run_command(["ip", "netns", "add", name])
        self._created_namespaces.append(name)

    def _build(self) -> None:
        switch = self.switch_namespace
        self._add_namespace(switch)
        run_command(
            [
                *("ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge"),
                *("forward_delay", "0", "stp_state", "0"),
            ]
        )
        run_command(["ip", "-n", switch, "link", "set", BRIDGE, "up"])
        for i in range(self.hosts):
            self._write_hosts_file(i)
            self._add_host(i)

    def _add_host(self, i: int) -> None:
        host, switch = self.namespaces[i], self.switch_namespace
        port = f"h{i}"
        self._add_namespace(host)
        # Both ends are created directly in their namespaces: nothing appears in the root one.
        run_command(
            [
                *("ip", "link", "add", HOST_INTERFACE, "netns", host, "type", "veth"),
                *("peer", "name", port, "netns", switch),
            ]
        )
        run_command(["ip", "-n", switch, "link", "set", port, "master", BRIDGE])
        run_command(["ip", "-n", switch, "link", "set", port, "up"])
        run_command(["ip", "-n", host, "link", "set", "lo", "up"])
        address = f"{self.host_addresses[i]}/24"
        run_command(["ip", "-n", host, "addr", "add", address, "dev", HOST_INTERFACE])
        run_command(["ip", "-n", host, "link", "set", HOST_INTERFACE, "up"])
        for argv in self.link.tc_commands(host, HOST_INTERFACE, with_delay=True):
            try:
                run_command(argv)
            except RuntimeError as error:
                if "netem" not in argv:
                    raise
                raise RuntimeError(
                    f"cannot add delay_ms={self.link.delay_ms}: the kernel may lack the netem "
                    f"qdisc (CONFIG_NET_SCH_NETEM): {error}"
                ) from error
        for argv in self.link.tc_commands(switch, port, with_delay=False):
            run_command(argv)

    def _write_hosts_file(self, i: int) -> None:
        """``/etc/netns/<ns_i>/hosts``: hostname -> host i, each namespace name -> its host."""
        config_dir = self.config_dirs[i]
        if not NETNS_CONFIG_DIR.exists():
            NETNS_CONFIG_DIR.mkdir(parents=True)
            self._created_config_root = True
        config_dir.mkdir(parents=True, exist_ok=False)
        self._created_config_dirs.append(config_dir)
        own_names = [name for name in (socket.gethostname(),) if name and name != "localhost"]
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        for j, (name, address) in enumerate(zip(self.namespaces, self.host_addresses, strict=True)):
            aliases = [*own_names, name] if j == i else [name]
            lines.append(f"{address} {' '.join(aliases)}")
        (config_dir / "hosts").write_text("\n".join(lines) + "\n")

    # -- teardown ----------------------------------------------------------------------------

    def _teardown(self) -> list[str]:
        """Delete namespaces (newest first) and config dirs; returns what could not be removed.

        Each item leaves its list only once it is gone, so a teardown interrupted by a signal
        (whose handler tears down too) leaves nothing behind.
        """
        failures: list[str] = []
        for name in reversed(list(self._created_namespaces)):
            try:
                if namespace_exists(name):
                    run_command(["ip", "netns", "delete", name])
            except RuntimeError as error:
                if namespace_exists(name):
                    failures.append(str(error))
                    continue
            if name in self._created_namespaces:
                self._created_namespaces.remove(name)
        for config_dir in list(self._created_config_dirs):
            try:
                shutil.rmtree(config_dir, ignore_errors=False)
            except FileNotFoundError:
                pass
            except OSError as error:
                failures.append(f"cannot remove {config_dir}: {error}")
                continue
            if config_dir in self._created_config_dirs:
                self._created_config_dirs.remove(config_dir)
        if self._created_config_root and not self._created_config_dirs:
            # Only if empty: other runs may be using it by now.
            with contextlib.suppress(OSError):
                NETNS_CONFIG_DIR.rmdir()
            self._created_config_root = False
        return failures

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _HANDLED_SIGNALS:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        while self._previous_handlers:
            signum, previous = self._previous_handlers.popitem()
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        failures = self._teardown()
        for failure in failures:
            print(f"netns: {failure}", file=sys.stderr)
        self._restore_signal_handlers()
        self._active = False
        if callable(previous):
            previous(signum, frame)
        else:
            # Default disposition: re-deliver the signal now that the handler is gone.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
