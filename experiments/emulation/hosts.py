"""Processes on emulated hosts: one per host, launched together as one distributed run.

Owns ``EmulatedHosts``, which runs a module (a host program of this package, or the
``jaxmoe`` command) as one process inside each host of an ``EmulatedNetwork``, through
``jaxmoe.cli.launch.launch`` (the coordinator on host 0), each run's log in a work
directory; and the two things every cluster experiment records or checks: the machine it
ran on, and that a layout fills the hosts.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
from collections.abc import Sequence
from pathlib import Path

from experiments.emulation.network import EmulatedNetwork
from jaxmoe.cli.launch import launch
from jaxmoe.config import Config, ConfigError


class HostRunFailed(RuntimeError):
    """A process of a run on the emulated hosts failed (the message ends with its log)."""


def check_hosts_fill_layout(config: Config, hosts: int, devices_per_host: int) -> None:
    """Refuse a layout whose device count is not ``hosts x devices_per_host``."""
    devices = hosts * devices_per_host
    if config.parallel.num_devices != devices:
        raise ConfigError(
            f"parallel.data x parallel.expert = {config.parallel.num_devices}, but "
            f"{hosts} hosts x {devices_per_host} devices = {devices}: "
            "pass --parallel.data/--parallel.expert to match"
        )


def machine() -> str:
    """The host, for results files (timings depend on its cores, shared by every process)."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores"


class EmulatedHosts:
    """Runs a module as one process per host of ``network``; logs and files go to
    ``workdir``, named after ``name`` (e.g. the link: ``shaped``, ``free``)."""

    def __init__(self, network: EmulatedNetwork, workdir: Path, name: str):
        self.network = network
        self.workdir = workdir
        self.name = name

    @property
    def count(self) -> int:
        """How many hosts (and so processes per run)."""
        return self.network.hosts

    def path(self, what: str) -> Path:
        """A file of this set of hosts in the work directory: ``<name>-<what>``."""
        return self.workdir / f"{self.name}-{what}"

    def write_config(self, config: Config) -> Path:
        """``config`` as the JSON file host programs read (``--config``)."""
        path = self.path("config.json")
        path.write_text(json.dumps(config.to_dict()))
        return path

    def run(self, label: str, args: Sequence[str], module: str = "jaxmoe.cli") -> None:
        """``python -m <module> <args>`` on every host, as one distributed run (each
        process gets ``--coordinator``, ``--num-processes`` and ``--process-id``).

        Raises:
            HostRunFailed: a process failed; the message ends with the run's log.
        """
        log_path = self.path(f"{label}.log")
        with log_path.open("w") as log:
            status = launch(
                list(args),
                self.count,
                coordinator_host=self.network.host_addresses[0],
                port=20000 + secrets.randbelow(20000),
                wrap=self.network.command,
                output=log,
                module=module,
            )
        if status != 0:
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
            raise HostRunFailed(f"{label} on the {self.name} link failed; its log ends:\n{tail}")
