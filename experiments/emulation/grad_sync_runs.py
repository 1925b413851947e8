"""Every gradient-sync algorithm trained on the emulated hosts, from one start of them.

The host program (run on every host by ``run_grad_sync``, for
``experiments.grad_sync_eval``)::

    python -m experiments.emulation.grad_sync_runs --config CONFIG.json --algorithms A,B \\
        --repeats 2 --json OUT [--compilation-cache DIR] \\
        [--coordinator HOST:PORT --num-processes N --process-id I]

Each host process starts once and then, for each repeat (in rotated order) and
each algorithm, runs ``jaxmoe.train.loop.train`` on the configuration with that
``train.grad_sync``, reading its host's link counter
(``/sys/class/net/eth0/statistics/tx_bytes``, inside the host's namespace)
before and after. Process I writes ``OUT.I.json``: per run the step times,
losses and bytes this host sent (``GradSyncRun``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.emulation.host_process import host_parser, start_host
from experiments.emulation.hosts import EmulatedHosts

COUNTER = Path("/sys/class/net/eth0/statistics/tx_bytes")


@dataclass(frozen=True)
class GradSyncRun:
    """One training run of one algorithm on one host."""

    algorithm: str
    repeat: int
    step_s: tuple[float, ...]
    loss: tuple[float, ...]
    link_bytes: int | None  # this host sent (None: the host has no eth0, e.g. loopback)


def sent_bytes() -> int | None:
    """This host's transmit counter (None where it has no ``eth0``, e.g. on loopback)."""
    return int(COUNTER.read_text()) if COUNTER.exists() else None


def rotated(items: list[str], shift: int) -> list[str]:
    shift %= len(items)
    return items[shift:] + items[:shift]


def run_grad_sync(
    hosts: EmulatedHosts,
    config_path: Path,
    algorithms: list[str],
    repeats: int,
    compilation_cache: Path | None = None,
) -> list[list[GradSyncRun]]:
    """Each host's runs (host i at index i), every algorithm ``repeats`` times."""
    prefix = hosts.path("runs")
    args = ["--config", str(config_path), "--algorithms", ",".join(algorithms)]
    args += ["--repeats", str(repeats), "--json", str(prefix)]
    if compilation_cache is not None:
        args += ["--compilation-cache", str(compilation_cache)]
    hosts.run("runs", args, module=__name__)
    return [read_runs(prefix, host) for host in range(hosts.count)]


def read_runs(prefix: Path, process: int) -> list[GradSyncRun]:
    """The runs process ``process`` wrote for ``--json prefix``."""
    rows = json.loads(prefix.with_name(f"{prefix.name}.{process}.json").read_text())
    return [
        GradSyncRun(
            row["algorithm"],
            row["repeat"],
            tuple(row["step_s"]),
            tuple(row["loss"]),
            row["link_bytes"],
        )
        for row in rows
    ]


def main(argv: list[str] | None = None) -> int:
    parser = host_parser(__doc__.splitlines()[0], output="process I writes JSON.I.json")
    parser.add_argument("--algorithms", required=True)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--compilation-cache", type=Path)
    args = parser.parse_args(argv)
    prepared = start_host(args)

    import jax

    from jaxmoe.prepare import prepare_run
    from jaxmoe.train.loop import train

    if args.compilation_cache is not None:
        jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    config = prepared.config
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
    path = args.json.with_name(f"{args.json.name}.{jax.process_index()}.json")
    path.write_text(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
