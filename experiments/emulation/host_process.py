"""Inside an emulated host: a host program's arguments, its start, and its rounds' order.

Every host program of this package takes a resolved ``config.json`` (written by
``EmulatedHosts.write_config``), its output file, and its place in the distributed run
(``--coordinator``, ``--num-processes``, ``--process-id``, which ``jaxmoe.cli.launch``
passes). ``start_host`` starts the process through the library
(``jaxmoe.prepare.start_process``: this host's share of the CPU devices, the distributed
runtime, the prepared run). Programs that time several variants side by side run them in
rounds whose order ``round_order`` gives.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def host_parser(description: str, output: str = "process 0 writes here") -> argparse.ArgumentParser:
    """The arguments every host program takes: the config, the output (``--json``, whose
    help is ``output``), the process's place in the run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, required=True, help="a resolved config.json")
    parser.add_argument("--json", type=Path, required=True, help=output)
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    return parser


def rounds_parser(description: str) -> argparse.ArgumentParser:
    """``host_parser`` with the rounds of a side-by-side timing: timed and untimed."""
    parser = host_parser(description)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    return parser


def start_host(args: argparse.Namespace) -> Any:
    """This host's part of the run (a ``jaxmoe.train.resolved.Run``): its fake devices
    set, the distributed runtime joined, the configuration prepared on the whole mesh."""
    from jaxmoe.config import Config
    from jaxmoe.parallel.distributed import DistributedConfig
    from jaxmoe.prepare import start_process

    config = Config.from_dict(json.loads(args.config.read_text()))
    distributed = DistributedConfig(args.coordinator, args.num_processes, args.process_id)
    return start_process(config, distributed)


def train_batches(config) -> Any:
    """The training batches of ``config`` (a ``BatchSampler``; each host builds its rows)."""
    from jaxmoe.data.mixture import load_mixture, run_batches

    return run_batches(config, load_mixture(config))[0]


def round_order(names: list[str], round_index: int) -> list[str]:
    """The order of a round: as listed in even rounds, reversed in odd ones, so that a
    drift of the machine falls on every variant alike."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))
