"""Sweep collective sizes on a mesh and fit the scheduler's link curves.

    python -m experiments.collective_sweep --parallel-data 2 --parallel-expert 4 \\
        --out curves.json [--coordinator HOST:PORT --num-processes N --process-id I]

Times ``all_to_all`` over the ``expert`` axis and ``psum`` over ``data``,
``expert`` and both, at operand sizes from ``--min-bytes`` to ``--max-bytes``
(each 4x the last), ``--repeats`` times each after a warm-up, and writes the
fitted ``scheduling.costs.link_model.CollectiveCurves`` (process 0).

Each sample is what one more collective adds: ``--chain`` collectives in one
program, each fed by the result of the one before (so that XLA can neither
merge nor reorder them), against a single one. The launch of the program,
which a step pays once and not once per collective, cancels out. Run it inside
the emulated cluster (``python -m experiments.cluster ... --sweep OUT``) to
measure the shaped link; ``--source`` says where it was measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel-data", type=int, required=True)
    parser.add_argument("--parallel-expert", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", default="this machine")
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=4 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chain", type=int, default=4)
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args(argv)

    from jaxmoe.config import ParallelConfig
    from jaxmoe.parallel.distributed import DistributedConfig, initialize
    from jaxmoe.parallel.host_devices import ensure_host_devices

    parallel = ParallelConfig(data=args.parallel_data, expert=args.parallel_expert)
    distributed = DistributedConfig(args.coordinator, args.num_processes, args.process_id)
    ensure_host_devices(parallel.num_devices // distributed.process_count_hint())
    initialize(distributed)

    import jax
    import jax.numpy as jnp

    from jaxmoe.parallel.mesh import DATA_AXIS, EXPERT_AXIS, build_mesh
    from jaxmoe.parallel.timing import time_per_device
    from scheduling import CollectiveCurves, PiecewiseLinear

    mesh = build_mesh(parallel)
    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 4

    def timed(collective, elements: int) -> list[float]:
        def chained(copies: int):
            def per_device(seed):
                for _ in range(copies):
                    # The operand depends on the previous result: no merging, no reordering.
                    seed = collective(jnp.full((elements,), seed, jnp.float32)) * 1e-9
                return seed

            return time_per_device(per_device, mesh, warmup=1, repeats=args.repeats)

        single, several = chained(1), chained(args.chain)
        pairs = zip(sorted(single), sorted(several), strict=True)
        return [max(m - s, 1e-6) / (args.chain - 1) for s, m in pairs]

    cases: list[tuple[str, tuple[str, ...]]] = [("all_to_all", (EXPERT_AXIS,))]
    cases += [("psum", axes) for axes in ((DATA_AXIS,), (EXPERT_AXIS,), (DATA_AXIS, EXPERT_AXIS))]
    curves = CollectiveCurves(source=args.source)
    for kind, axes in cases:
        group = 1
        for axis in axes:
            group *= mesh.shape[axis]
        if group == 1:
            continue
        samples = []
        for nbytes in sizes:
            elements = max(group, nbytes // 4 // group * group)

            def collective(x, kind=kind, axes=axes, group=group):
                if kind == "all_to_all":
                    parts = x.reshape(group, -1)
                    out = jax.lax.all_to_all(parts, axes[0], 0, 0)
                    return jnp.sum(out)
                return jnp.sum(jax.lax.psum(x, axes))

            samples += [(elements * 4, s) for s in timed(collective, elements)]
        curves.curves[(kind, group)] = PiecewiseLinear.fit(samples)
    if jax.process_index() == 0:
        curves.save(args.out)
        for (kind, group), curve in sorted(curves.curves.items()):
            points = ", ".join(
                f"{int(b) >> 10} KiB {s * 1e3:.2f} ms"
                for b, s in zip(curve.sizes, curve.seconds, strict=True)
            )
            print(f"{kind} over {group}: {points}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
