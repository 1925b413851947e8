"""One host's part of ``experiments.grad_sync_eval``: train every algorithm in one process.

    python -m experiments.grad_sync_runner --config CONFIG.json --algorithms A,B \\
        --repeats 2 --json-prefix OUT [--coordinator HOST:PORT --num-processes N --process-id I]

Each host process starts once and then, for each repeat (in rotated order) and
each algorithm, runs ``jaxmoe.train.loop.train`` on the configuration with that
``train.grad_sync``, reading its host's link counter
(``/sys/class/net/eth0/statistics/tx_bytes``, inside the host's namespace)
before and after. Process I writes ``OUT.I.json``: per run the step times,
losses and bytes this host sent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

COUNTER = Path("/sys/class/net/eth0/statistics/tx_bytes")


def sent_bytes() -> int | None:
    """This host's transmit counter (None where it has no ``eth0``, e.g. on loopback)."""
    return int(COUNTER.read_text()) if COUNTER.exists() else None


def rotated(items: list[str], shift: int) -> list[str]:
    shift %= len(items)
    return items[shift:] + items[:shift]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a resolved config.json")
    parser.add_argument("--algorithms", required=True)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json-prefix", type=Path, required=True)
    parser.add_argument("--compilation-cache", type=Path)
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args(argv)

    from jaxmoe.config import Config
    from jaxmoe.parallel.distributed import DistributedConfig, initialize
    from jaxmoe.parallel.host_devices import ensure_host_devices

    config = Config.from_dict(json.loads(args.config.read_text()))
    distributed = DistributedConfig(args.coordinator, args.num_processes, args.process_id)
    ensure_host_devices(config.parallel.num_devices // distributed.process_count_hint())
    initialize(distributed)

    import jax

    from jaxmoe.prepare import prepare_run
    from jaxmoe.train.loop import train

    if args.compilation_cache is not None:
        jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    algorithms = [a for a in args.algorithms.split(",") if a]
    runs = []
    for repeat in range(args.repeats):
        for algorithm in rotated(algorithms, repeat):
            train_config = dataclasses.replace(config.train, grad_sync=algorithm)
            before = sent_bytes()
            rows = train(
                prepare_run(dataclasses.replace(config, train=train_config)), progress=False
            )
            after = sent_bytes()
            sent = None if before is None or after is None else after - before
            runs.append(
                {
                    "algorithm": algorithm,
                    "repeat": repeat,
                    "step_s": [row["step_time_s"] for row in rows],
                    "loss": [row["loss"] for row in rows],
                    "link_bytes": sent,
                }
            )
            if jax.process_index() == 0:
                print(f"{algorithm} #{repeat}: loss {rows[-1]['loss']:.3f}", flush=True)
    path = args.json_prefix.with_name(f"{args.json_prefix.name}.{jax.process_index()}.json")
    path.write_text(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
