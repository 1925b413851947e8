"""Processes on emulated hosts: one per host, launched together as one distributed run."""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
from pathlib import Path

from experiments.netns import EmulatedNetwork
from jaxmoe.cli.launch import launch


def check_hosts_fill_layout(config, hosts: int, devices_per_host: int) -> None:
    """Refuse a layout whose device count is not ``hosts x devices_per_host``."""
    from jaxmoe.config import ConfigError

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


class Cluster:
    """Runs commands as one process per emulated host; logs go to ``workdir``."""

    def __init__(self, network: EmulatedNetwork, workdir: Path, name: str):
        self.network = network
        self.workdir = workdir
        self.name = name

    def run(self, label: str, command_args: list[str], module: str = "jaxmoe.cli") -> None:
        log_path = self.workdir / f"{self.name}-{label}.log"
        with log_path.open("w") as log:
            status = launch(
                command_args,
                len(self.network.namespaces),
                coordinator_host=self.network.host_addresses[0],
                port=20000 + secrets.randbelow(20000),
                wrap=self.network.command,
                output=log,
                module=module,
            )
        if status != 0:
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
            raise RuntimeError(f"{label} on the {self.name} link failed; its log ends:\n{tail}")

    def step_rounds(
        self, config_path: Path, schedules: list[str], rounds: int, warmup: int
    ) -> dict[str, list[float]]:
        """Seconds per round of each schedule's training step (``experiments.step_rounds``)."""
        out = self.workdir / f"{self.name}-rounds.json"
        args = ["--config", str(config_path), "--schedules", ",".join(schedules)]
        args += ["--rounds", str(rounds), "--warmup", str(warmup), "--json", str(out)]
        self.run("step-rounds", args, module="experiments.step_rounds")
        return json.loads(out.read_text())["seconds"]

    def sweep(self, config, args: argparse.Namespace, out: Path) -> None:
        source = (
            f"emulated cluster: {args.hosts} hosts x {args.devices_per_host} devices, "
            f"{args.link_mbit:g} Mbit/s, {args.delay_ms:g} ms"
        )
        command = ["--parallel-data", str(config.parallel.data)]
        command += ["--parallel-expert", str(config.parallel.expert)]
        command += ["--out", str(out), "--source", source]
        self.run("collective-sweep", command, module="experiments.collective_sweep")

    def collectives_only(self, config_path: Path, repeats: int) -> float:
        out = self.workdir / f"{self.name}-collectives.json"
        args = ["--config", str(config_path), "--json", str(out), "--repeats", str(repeats)]
        self.run("collectives-only", args, module="experiments.collectives_only")
        return json.loads(out.read_text())["median_s"]
