"""How much all-to-all time each schedule leaves exposed, forward and backward (simulator).

Lancet partitions only the forward pass; the backward all-to-alls are hidden
by dW work instead. This asks the cost model whether that leaves anything for
a backward partition to win: for each schedule it sums, per phase, the
all-to-all time and the part of it the compute stream still waits for.

    python -m experiments.backward_overlap --preset gpt2-moe-12 --profile a100
"""

from __future__ import annotations

import argparse
import sys

from experiments.shared.results_file import command_line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-moe-12")
    parser.add_argument("--profile", default="a100")
    parser.add_argument("--schedules", default="async,dw,partition,lancet")
    args = parser.parse_args(argv)

    import dataclasses

    from jaxmoe.parallel.distributed import DistributedConfig
    from jaxmoe.prepare import start_process
    from jaxmoe.presets import preset
    from jaxmoe.train.scheduled import scheduled_train_step

    prepared = start_process(preset(args.preset), DistributedConfig())
    config, mesh = prepared.config, prepared.mesh
    command = command_line("experiments.backward_overlap", sys.argv[1:] if argv is None else argv)
    print(f"Command: `{command}`\n")
    print("| schedule | phase | all-to-all (us) | exposed (us) | exposed share |")
    print("|---|---|---|---|---|")
    for schedule in args.schedules.split(","):
        section = dataclasses.replace(config.schedule, name=schedule, profile=args.profile)
        report = scheduled_train_step(dataclasses.replace(config, schedule=section), mesh).report
        for phase in ("forward", "backward"):
            rows = [c for c in report.collectives if c.kind == "all_to_all" and c.phase == phase]
            total = sum(c.estimated_seconds for c in rows)
            exposed = sum(c.estimated_seconds - c.overlap_seconds for c in rows)
            share = exposed / total if total else 0.0
            print(
                f"| {schedule} | {phase} | {total * 1e6:.1f} | {exposed * 1e6:.1f} | {share:.2f} |"
            )


if __name__ == "__main__":
    main()
