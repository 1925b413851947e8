"""``jaxmoe link-curves``: measure the mesh's collectives and write the curves file that
``--schedule.link_curves`` reads (:mod:`jaxmoe.plan.link_curves`).

Runs on the configuration's mesh, in one process or as one process of several (the
same flags as ``jaxmoe train``); process 0 writes the file.
"""

from __future__ import annotations

import argparse

from jaxmoe.config import Config, ConfigError


def run(config: Config, args: argparse.Namespace) -> int:
    for name in ("min_bytes", "max_bytes", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.chain < 2:
        raise ConfigError(f"--chain {args.chain}: time at least 2 collectives per program")

    import jax

    from jaxmoe.cli.train_command import distributed_config
    from jaxmoe.parallel.distributed import initialize
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.plan.link_curves import describe, measure_link_curves

    initialize(distributed_config(args))
    curves = measure_link_curves(
        build_mesh(config.parallel),
        source=args.source,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        repeats=args.repeats,
        chain=args.chain,
    )
    if jax.process_index() == 0:
        curves.save(args.out)
        print(describe(curves))
        print(f"wrote {args.out}")
    return 0
