"""The communication of one train step, alone: its collectives at their sizes, nothing else.

The host program (run on every emulated host by ``run_collectives_only``)::

    python -m experiments.emulation.collectives_only --config CONFIG.json --json OUT.json \\
        [--coordinator HOST:PORT --num-processes N --process-id I] [--repeats 10]

The train step of the configuration is captured as its per-device program
(``scheduling.capture``); every collective of it (forward and backward
all-to-alls, gradient psums, metric reductions) is replayed with the same
primitive, parameters, shapes and dtypes, in program order, on inputs that
carry no data dependence on any computation. Each collective's operand is
filled from the sum of the results before it: it waits for the previous one,
and XLA can neither merge two collectives of equal shape into one nor
combine or reorder them. Every result reaches the output, so none is dead. Process 0
writes the wall time of each repeat of the whole sequence: a ``CollectivesOnly``. The
emulated cluster runs it with the same processes and links as the training run.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.emulation.host_process import host_parser, start_host
from experiments.emulation.hosts import EmulatedHosts
from jaxmoe.train.resolved import resolve


@dataclass(frozen=True)
class CollectivesOnly:
    """Seconds of each repeat of the step's collectives, and how many there are."""

    seconds: tuple[float, ...]
    collectives: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def run_collectives_only(
    hosts: EmulatedHosts, config_path: Path, repeats: int, warmup: int = 2
) -> CollectivesOnly:
    """The step's collectives alone, ``repeats`` times after ``warmup``, on every host."""
    out = hosts.path("collectives.json")
    args = ["--config", str(config_path), "--json", str(out)]
    args += ["--repeats", str(repeats), "--warmup", str(warmup)]
    hosts.run("collectives-only", args, module=__name__)
    data = json.loads(out.read_text())
    return CollectivesOnly(tuple(data["seconds"]), data["collectives"])


def main(argv: list[str] | None = None) -> int:
    parser = host_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    prepared = start_host(args)

    import jax
    import jax.numpy as jnp

    from jaxmoe.parallel.timing import time_per_device
    from jaxmoe.train.scheduled import capture_train_step

    mesh = prepared.mesh
    program, _ = capture_train_step(resolve(prepared.config, mesh))
    collectives = program.collectives()

    def per_device(seed: jax.Array) -> jax.Array:
        total = jnp.float32(0)
        for op in collectives:
            (operand,) = op.inputs
            # A data dependence, not an optimization barrier: XLA's CPU pipeline drops
            # barriers before it merges equal collectives.
            fill = (seed + total * 1e-30).astype(operand.aval.dtype)
            value = jnp.full(operand.aval.shape, fill, operand.aval.dtype)
            (result,) = op.bind([value])
            total = total + jnp.sum(result).astype(jnp.float32)
        return total

    seconds = time_per_device(per_device, mesh, warmup=args.warmup, repeats=args.repeats)
    if jax.process_index() == 0:
        report = {
            "median_s": statistics.median(seconds),
            "collectives": len(collectives),
            "seconds": seconds,
        }
        args.json.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
