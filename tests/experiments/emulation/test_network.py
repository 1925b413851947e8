"""Tests for experiments.emulation.network: emulated hosts in network namespaces (needs
root and iproute2).

All traffic stays inside the namespaces the tests create; every test removes what it made.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from experiments.emulation import network
from experiments.emulation.network import (
    EmulatedNetwork,
    LinkShape,
    namespace_exists,
    namespaces_available,
    netem_available,
)

_AVAILABLE, _REASON = namespaces_available()
if not _AVAILABLE:
    pytest.skip(_REASON, allow_module_level=True)

REPO_ROOT = Path(__file__).resolve().parents[3]
STEP_TIMEOUT_S = 15.0

# Listens on (address, any port), prints the port, then answers one connection: echoes what
# it received (mode "echo") or, after the client half-closes, the number of bytes received.
SERVER = textwrap.dedent(
    """
    import socket, sys
    address, mode = sys.argv[1], sys.argv[2]
    with socket.create_server((address, 0)) as server:
        server.settimeout(10)
        print(server.getsockname()[1], flush=True)
        connection, _ = server.accept()
        with connection:
            connection.settimeout(10)
            if mode == "echo":
                connection.sendall(connection.recv(4096))
            else:
                total = 0
                while chunk := connection.recv(1 << 16):
                    total += len(chunk)
                connection.sendall(str(total).encode())
    """
)

# Connects to (address, port); "echo" sends a message and prints the reply, "bulk N" sends N
# bytes and prints {"bytes": acknowledged, "seconds": until the acknowledgement}.
CLIENT = textwrap.dedent(
    """
    import json, socket, sys, time
    address, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with socket.create_connection((address, port), timeout=10) as connection:
        if mode == "echo":
            connection.sendall(b"hello from host 0")
            print(connection.recv(4096).decode(), flush=True)
        else:
            payload = b"x" * int(sys.argv[4])
            start = time.perf_counter()
            connection.sendall(payload)
            connection.shutdown(socket.SHUT_WR)
            acknowledged = int(connection.recv(64))
            seconds = time.perf_counter() - start
            print(json.dumps({"bytes": acknowledged, "seconds": seconds}), flush=True)
    """
)


def _stop(process: subprocess.Popen[str]) -> None:
    """Kill ``process`` if it still runs, and close its pipes."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """One stdout line of ``process``, failing the test if none comes within ``timeout``."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output from {process.args} within {timeout} s")
    line = process.stdout.readline().strip()
    if not line:
        stderr = process.stderr.read() if process.stderr else ""
        raise AssertionError(f"{process.args} exited without output: {stderr}")
    return line


@contextmanager
def _server(net: EmulatedNetwork, host: int, mode: str) -> Iterator[int]:
    """Runs SERVER in ``host``'s namespace; yields its port; kills it on the way out."""
    argv = [sys.executable, "-c", SERVER, net.host_addresses[host], mode]
    process = subprocess.Popen(
        net.command(host, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield int(_read_line(process, STEP_TIMEOUT_S))
        process.wait(timeout=STEP_TIMEOUT_S)
    finally:
        _stop(process)


def _client(net: EmulatedNetwork, host: int, *args: str) -> str:
    argv = [sys.executable, "-c", CLIENT, *args]
    completed = subprocess.run(
        net.command(host, argv), capture_output=True, text=True, timeout=STEP_TIMEOUT_S
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip()


def _listed_namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


def _assert_removed(names: list[str], config_dirs: list[Path]) -> None:
    assert not set(names) & _listed_namespaces()
    assert not any(path.exists() for path in config_dirs)


def _force_remove(names: list[str], config_dirs: list[Path]) -> None:
    """Last-resort cleanup for tests whose network lives in another process."""
    for name in names:
        if namespace_exists(name):
            subprocess.run(["ip", "netns", "delete", name], check=False)
    for path in config_dirs:
        shutil.rmtree(path, ignore_errors=True)


def _throughput_mbit(link: LinkShape, payload_bytes: int) -> float:
    with EmulatedNetwork(2, link) as net, _server(net, 1, "bulk") as port:
        reply = _client(net, 0, net.host_addresses[1], str(port), "bulk", str(payload_bytes))
    measured = json.loads(reply)
    assert measured["bytes"] == payload_bytes
    return measured["bytes"] * 8 / measured["seconds"] / 1e6


# -- LinkShape --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate_mbit": 0}, "rate_mbit"),
        ({"rate_mbit": -5.0}, "rate_mbit"),
        ({"rate_mbit": float("inf")}, "rate_mbit"),
        ({"rate_mbit": float("nan")}, "rate_mbit"),
        ({"rate_mbit": None, "delay_ms": -1.0}, "delay_ms"),
        ({"rate_mbit": 10.0, "delay_ms": float("nan")}, "delay_ms"),
    ],
)
def test_link_shape_rejects_bad_values(kwargs: dict[str, float | None], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LinkShape(**kwargs)


def test_link_shape_accepts_good_values_and_builds_tc_commands() -> None:
    assert LinkShape(None).tc_commands("ns", "eth0", with_delay=True) == []
    (tbf,) = LinkShape(20).tc_commands("ns", "eth0", with_delay=True)
    assert tbf[:8] == ["tc", "-n", "ns", "qdisc", "add", "dev", "eth0", "root"]
    assert "tbf" in tbf and "20000000bit" in tbf
    netem_cmd, tbf_child = LinkShape(20, delay_ms=2.5).tc_commands("ns", "eth0", with_delay=True)
    assert netem_cmd[7:11] == ["root", "handle", "1:", "netem"] and "2500us" in netem_cmd
    assert tbf_child[7:9] == ["parent", "1:1"] and "tbf" in tbf_child
    # The switch end of a link gets the rate only.
    (switch_side,) = LinkShape(20, delay_ms=2.5).tc_commands("sw", "h0", with_delay=False)
    assert "netem" not in switch_side and "root" in switch_side


# -- lifecycle --------------------------------------------------------------------------------


def test_enter_creates_namespaces_with_addresses_and_exit_removes_them() -> None:
    net = EmulatedNetwork(3, LinkShape(rate_mbit=50))
    names = [*net.namespaces, net.switch_namespace]
    config_dirs = net.config_dirs
    with net:
        assert set(names) <= _listed_namespaces()
        for name, address in zip(net.namespaces, net.host_addresses, strict=True):
            shown = subprocess.run(
                ["ip", "-n", name, "-4", "-o", "addr", "show", "dev", network.HOST_INTERFACE],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert f"inet {address}/24" in shown
            assert (network.NETNS_CONFIG_DIR / name / "hosts").is_file()
        assert len(set(net.host_addresses)) == 3
    _assert_removed(names, config_dirs)
    net.close()  # idempotent
    net.__exit__(None, None, None)


def test_exit_removes_everything_after_an_exception_inside_the_with() -> None:
    net = EmulatedNetwork(2, LinkShape(rate_mbit=None))
    names = [*net.namespaces, net.switch_namespace]
    with pytest.raises(KeyError, match="boom"), net:
        assert set(names) <= _listed_namespaces()
        raise KeyError("boom")
    _assert_removed(names, net.config_dirs)


def test_half_built_network_is_removed_when_a_command_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    net = EmulatedNetwork(2, LinkShape(rate_mbit=10))
    real_run = network.run_command
    calls: list[list[str]] = []

    def fail_on_second_host(argv: list[str]) -> str:
        calls.append(list(argv))
        if argv[:3] == ["ip", "netns", "add"] and argv[3] == net.namespaces[1]:
            return real_run(["ip", "link", "show", "dev", "no-such-device-jm"])
        return real_run(argv)

    monkeypatch.setattr(network, "run_command", fail_on_second_host)
    with pytest.raises(RuntimeError, match="no-such-device-jm"), net:
        pass
    assert any(argv[3:4] == [net.namespaces[0]] for argv in calls)  # got half-way
    _assert_removed([*net.namespaces, net.switch_namespace], net.config_dirs)


def test_command_failures_name_the_command_and_its_stderr() -> None:
    with pytest.raises(RuntimeError) as raised:
        network.run_command(["ip", "link", "show", "dev", "no-such-device-jm"])
    message = str(raised.value)
    assert "ip link show dev no-such-device-jm" in message
    assert "does not exist" in message or "Cannot find" in message


def test_enter_raises_permission_error_when_namespaces_are_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(network, "namespaces_available", lambda: (False, "not running as root"))
    net = EmulatedNetwork(2, LinkShape(rate_mbit=None))
    with pytest.raises(PermissionError, match=r"needs root and iproute2.*not running as root"):
        net.__enter__()
    assert not set(net.namespaces) & _listed_namespaces()


def test_signal_handlers_are_restored_on_exit() -> None:
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with EmulatedNetwork(1, LinkShape(rate_mbit=None)):
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    assert {signum: signal.getsignal(signum) for signum in before} == before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_tears_the_network_down_before_the_process_exits(signum: int) -> None:
    script = textwrap.dedent(
        """
        import json, signal, time
        from experiments.emulation.network import EmulatedNetwork, LinkShape
        # A background job of a non-interactive shell starts with SIGINT ignored (and then
        # EmulatedNetwork leaves it alone); act like a foreground program instead.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with EmulatedNetwork(2, LinkShape(rate_mbit=None)) as net:
            names = [*net.namespaces, net.switch_namespace]
            print(json.dumps([names, [str(p) for p in net.config_dirs]]), flush=True)
            time.sleep(60)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    names: list[str] = []
    config_dirs: list[Path] = []
    try:
        names, dirs = json.loads(_read_line(process, STEP_TIMEOUT_S))
        config_dirs = [Path(d) for d in dirs]
        assert set(names) <= _listed_namespaces()
        process.send_signal(signum)
        process.wait(timeout=STEP_TIMEOUT_S)
        assert process.returncode == -signum
        _assert_removed(names, config_dirs)
    finally:
        _stop(process)
        _force_remove(names, config_dirs)


# -- traffic ----------------------------------------------------------------------------------


def test_host_zero_reaches_host_one_over_tcp() -> None:
    with EmulatedNetwork(2, LinkShape(rate_mbit=100)) as net, _server(net, 1, "echo") as port:
        reply = _client(net, 0, net.host_addresses[1], str(port), "echo")
    assert reply == "hello from host 0"


def test_hostname_resolves_to_each_hosts_own_address() -> None:
    code = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    localhost_code = "import socket; print(socket.gethostbyname('localhost'))"
    with EmulatedNetwork(2, LinkShape(rate_mbit=None)) as net:

        def printed_on(host: int, source: str) -> str:
            return subprocess.run(
                net.command(host, [sys.executable, "-c", source]),
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT_S,
                check=True,
            ).stdout.strip()

        for i, address in enumerate(net.host_addresses):
            assert printed_on(i, code) == address
            assert printed_on(i, localhost_code) == "127.0.0.1"


def test_rate_limit_shapes_throughput() -> None:
    payload_bytes = 2_000_000
    shaped = _throughput_mbit(LinkShape(rate_mbit=20), payload_bytes)
    unshaped = _throughput_mbit(LinkShape(rate_mbit=None), payload_bytes)
    print(f"shaped {shaped:.1f} Mbit/s, unshaped {unshaped:.1f} Mbit/s")
    assert 10 < shaped < 30, f"shaped to 20 Mbit/s but measured {shaped:.1f} Mbit/s"
    assert unshaped > 100, f"unshaped link measured only {unshaped:.1f} Mbit/s"


def test_delay_is_added_or_refused_clearly() -> None:
    has_netem, reason = netem_available()
    net = EmulatedNetwork(2, LinkShape(rate_mbit=None, delay_ms=20))
    if not has_netem:
        with pytest.raises(RuntimeError, match="netem"), net:
            pass
        _assert_removed([*net.namespaces, net.switch_namespace], net.config_dirs)
        pytest.skip(f"delay not measurable here: {reason}")
    # One-way delay 20 ms between hosts: a TCP round trip (connect) takes at least 40 ms.
    code = textwrap.dedent(
        f"""
        import socket, time
        start = time.perf_counter()
        try:
            socket.create_connection(({net.host_addresses[1]!r}, 9), timeout=5).close()
        except ConnectionRefusedError:
            pass
        print(time.perf_counter() - start)
        """
    )
    with net:
        seconds = float(
            subprocess.run(
                net.command(0, [sys.executable, "-c", code]),
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT_S,
                check=True,
            ).stdout
        )
    assert 0.035 < seconds < 1.0
