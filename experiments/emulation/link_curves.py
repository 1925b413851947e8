"""Measured link curves on the emulated hosts: ``jaxmoe link-curves`` run on every host.

``run_link_curves`` runs the library's command (``python -m jaxmoe.cli link-curves``,
:mod:`jaxmoe.plan.link_curves`) as one process per host, on the mesh of the run's
configuration, and it writes the curves file that ``--schedule.link_curves`` reads.
The configuration reaches the command as its flags: ``config_flags``.
"""

from __future__ import annotations

from pathlib import Path

from experiments.emulation.hosts import EmulatedHosts
from jaxmoe.config import Config


def _flag_value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def config_flags(config: Config) -> list[str]:
    """The ``--SECTION.FIELD VALUE`` flags that make ``config`` from the default preset:
    ``config_from_train_args(config_flags(config)) == config``."""
    from jaxmoe.cli.parser import config_from_train_args

    base = config_from_train_args([]).to_dict()
    flags = []
    for section, fields in config.to_dict().items():
        for field, value in fields.items():
            if base[section].get(field) != value:
                flags += [f"--{section}.{field}", _flag_value(value)]
    return flags


def run_link_curves(hosts: EmulatedHosts, config: Config, out: Path, source: str) -> None:
    """Time the collectives of ``config``'s mesh on the hosts; process 0 writes the fitted
    curves to ``out``, saying they were measured on ``source``."""
    args = ["link-curves", *config_flags(config), "--out", str(out.resolve())]
    hosts.run("link-curves", [*args, "--source", source])
