"""``jaxmoe plan``: every parallel mapping of the model on N devices, estimated and ranked.

Traces on an abstract mesh, so N may exceed this host's devices; see
:mod:`jaxmoe.plan.planner`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from jaxmoe.cli.parser import config_name
from jaxmoe.config import Config, ConfigError


def run(config: Config, args: argparse.Namespace) -> int:
    from jaxmoe.plan import plan_table, planner
    from jaxmoe.plan.estimates import default_cache_dir

    schedules = [name.strip() for name in args.schedule.split(",") if name.strip()]
    if args.json is not None:
        folder = Path(args.json).parent
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            raise ConfigError(f"--json {args.json}: {folder} is not a writable directory")
    result = planner.plan_mappings(
        config,
        config_name(args),
        args.devices,
        args.profile,
        schedules,
        cache_dir=None if args.no_cache else default_cache_dir(),
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        extrapolate_layers=not args.trace_every_layer,
        time_limit=args.time_limit,
        top=args.top,
        jobs=args.jobs,
        gap=args.gap,
    )
    print(plan_table.table(result, verbose=args.verbose))
    if args.json is not None:
        command = "jaxmoe " + shlex.join(args.argv)
        Path(args.json).write_text(json.dumps(result.to_json(command), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
