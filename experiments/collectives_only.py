"""The communication of one train step, alone: its collectives at their sizes, nothing else.

    python -m experiments.collectives_only --config CONFIG.json --json OUT.json \\
        [--coordinator HOST:PORT --num-processes N --process-id I] [--repeats 10]

The train step of the configuration is captured as its per-device program
(``scheduling.capture``); every collective of it (forward and backward
all-to-alls, gradient psums, metric reductions) is replayed with the same
primitive, parameters, shapes and dtypes, in program order, on inputs that
carry no data dependence on any computation. Each collective's operand is
filled from the sum of the results before it: it waits for the previous one,
and XLA can neither merge two collectives of equal shape into one nor
combine or reorder them. Every result reaches the output, so none is dead. Process 0 writes the
median wall time of the whole sequence to ``--json``. The emulated cluster
runs it with the same processes and links as the training run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="a resolved config.json")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
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
    import jax.numpy as jnp

    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.parallel.timing import time_per_device
    from jaxmoe.train.scheduled import capture_train_step

    mesh = build_mesh(config.parallel)
    program, _ = capture_train_step(config, mesh)
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
        args.json.write_text(
            json.dumps(
                {
                    "median_s": statistics.median(seconds),
                    "collectives": len(collectives),
                    "seconds": seconds,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
