"""A peer that dies in the middle of a socket all-to-all on the emulated hosts ends the
whole run within 10 s, and nothing of it remains: no namespace, no process (needs root
and iproute2)."""

from __future__ import annotations

import subprocess
import time

import pytest

from experiments.emulation.hosts import EmulatedHosts, HostRunFailed
from experiments.emulation.network import EmulatedNetwork, LinkShape, namespaces_available

_AVAILABLE, _REASON = namespaces_available()
if not _AVAILABLE:
    pytest.skip(_REASON, allow_module_level=True)

HOST_PROGRAM = "tests.experiments.emulation.peer_death_host"


def _listed_namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


def test_a_killed_peer_ends_the_run_within_10_s_and_leaves_nothing(tmp_path):
    with EmulatedNetwork(2, LinkShape(rate_mbit=None), prefix="jaxmoe-death") as net:
        names = [*net.namespaces, net.switch_namespace]
        hosts = EmulatedHosts(net, tmp_path, "free")
        with pytest.raises(HostRunFailed, match="death on the free link failed"):
            hosts.run("death", ["--out", str(tmp_path)], module=HOST_PROGRAM)
        ended = time.time()
    killed = float((tmp_path / "killed").read_text())
    assert ended - killed < 10
    assert not set(names) & _listed_namespaces()
    running = subprocess.run(["pgrep", "-f", HOST_PROGRAM], capture_output=True, text=True)
    assert running.returncode == 1, running.stdout
