"""Training-step times of several schedules, interleaved: compile each once, then run rounds.

    python -m experiments.step_rounds --config CONFIG.json --schedules none,dw --rounds 10 \\
        --warmup 2 --json OUT.json [--coordinator HOST:PORT --num-processes N --process-id I]

Every schedule's step is compiled once in this process, each with its own train state
(the same initial state for all). Then each round runs one training step of every
schedule, in the listed order in even rounds and reversed in odd ones, so that a drift of
the machine (other work on its cores, a warming cache) falls on every schedule alike and
a schedule's position in the round does not favour it. All schedules of a round train on
the same batch. ``--warmup`` rounds run first and are not timed. Process 0 writes, per
schedule, the seconds of each timed round (index r of every list is round r) and the
order of every round; ``experiments.cluster`` runs it on each emulated host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any


def with_schedule(config, schedule: str):
    """``config`` with ``schedule.name`` set from a cluster entry ``NAME`` or ``NAME:N``."""
    name, _, chunks = schedule.partition(":")
    section = dataclasses.replace(
        config.schedule, name=name, partition_chunks=int(chunks) if chunks else None
    )
    return dataclasses.replace(config, schedule=section)


def round_order(schedules: list[str], round_index: int) -> list[str]:
    """The order of a round: as listed in even rounds, reversed in odd ones."""
    return list(schedules) if round_index % 2 == 0 else list(reversed(schedules))


def rounds_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a host's rounds: the config, rounds, output, and the process's place
    in the distributed run (``jaxmoe.cli.launch`` passes those)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, required=True, help="a resolved config.json")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    return parser


def start_host(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """This host's part of the run: ``(config, mesh, batch sampler)``, with its fake devices
    set and the distributed runtime joined."""
    from jaxmoe.config import Config
    from jaxmoe.parallel.distributed import DistributedConfig, initialize
    from jaxmoe.parallel.host_devices import ensure_host_devices

    config = Config.from_dict(json.loads(args.config.read_text()))
    distributed = DistributedConfig(args.coordinator, args.num_processes, args.process_id)
    ensure_host_devices(config.parallel.num_devices // distributed.process_count_hint())
    initialize(distributed)

    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.data import BatchSampler, load_splits

    sampler = BatchSampler(
        load_splits(config).train, config.model.seq_len, config.train.batch_size, config.train.seed
    )
    return config, build_mesh(config.parallel), sampler


def main(argv: list[str] | None = None) -> int:
    parser = rounds_parser(__doc__.splitlines()[0])
    parser.add_argument("--schedules", required=True, help="comma-separated NAME or NAME:N")
    args = parser.parse_args(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    config, mesh, sampler = start_host(args)

    import jax

    from jaxmoe.train.data import put_on_mesh
    from jaxmoe.train.scheduled import plan_train_step
    from jaxmoe.train.state import init_train_state

    steps, states, compile_s = {}, {}, {}
    for schedule in schedules:
        started = time.perf_counter()
        steps[schedule] = plan_train_step(with_schedule(config, schedule), mesh).compile()
        compile_s[schedule] = time.perf_counter() - started
        states[schedule] = init_train_state(config, mesh)

    seconds: dict[str, list[float]] = {schedule: [] for schedule in schedules}
    orders = []
    for round_index in range(args.warmup + args.rounds):
        batch = put_on_mesh(sampler, round_index, mesh)
        jax.block_until_ready(batch)
        order = round_order(schedules, round_index)
        for schedule in order:
            started = time.perf_counter()
            states[schedule], metrics = steps[schedule](states[schedule], batch)
            jax.block_until_ready((states[schedule], metrics))
            if round_index >= args.warmup:
                seconds[schedule].append(time.perf_counter() - started)
        if round_index >= args.warmup:
            orders.append(order)
    if jax.process_index() == 0:
        report = {"seconds": seconds, "orders": orders, "compile_s": compile_s}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
