"""How many collectives the compiled train step has, per schedule.

    python -m experiments.count_collectives [--preset tiny] [--schedules none,dw] \\
        [jaxmoe train overrides, e.g. --schedule.async_min_bytes 262144]

Compiles the step for each schedule and counts the all-reduce and all-to-all
instructions XLA kept: splitting reductions into async pairs stops XLA's
combiner from merging them, which this makes visible.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxmoe.train.resolved import resolve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--schedules", default="none,dw")
    args, overrides = parser.parse_known_args(argv)

    from jaxmoe.cli.parser import config_from_train_args
    from jaxmoe.parallel.distributed import DistributedConfig
    from jaxmoe.prepare import start_process

    config = config_from_train_args(["--preset", args.preset, *overrides])
    prepared = start_process(config, DistributedConfig())
    config, mesh = prepared.config, prepared.mesh

    from jaxmoe.train.scheduled import scheduled_train_step

    print("| schedule | all-reduce | all-to-all |\n|---|---|---|")
    for schedule in args.schedules.split(","):
        scheduled = dataclasses.replace(
            config, schedule=dataclasses.replace(config.schedule, name=schedule)
        )
        planned = scheduled_train_step(resolve(scheduled, mesh))
        text = planned.step.lower(*planned.example).compile().as_text()
        print(f"| {schedule} | {text.count(' all-reduce(')} | {text.count(' all-to-all(')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
