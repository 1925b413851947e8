"""How much all-to-all time each schedule leaves exposed, forward and backward (simulator).

Lancet partitions only the forward pass; the backward all-to-alls are hidden
by dW work instead. This asks the cost model whether that leaves anything for
a backward partition to win: for each schedule it sums, per phase, the
all-to-all time and the part of it the compute stream still waits for.

    python -m experiments.backward_overlap --preset gpt2-moe-12 --profile a100
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-moe-12")
    parser.add_argument("--profile", default="a100")
    parser.add_argument("--schedules", default="async,dw,partition,lancet")
    args = parser.parse_args(argv)

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import dataclasses

    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.presets import preset
    from jaxmoe.train.scheduled import plan_train_step

    config = preset(args.preset)
    mesh = build_mesh(config.parallel)
    command = "python -m experiments.backward_overlap " + " ".join(argv or sys.argv[1:])
    print(f"Command: `{command.strip()}`\n")
    print("| schedule | phase | all-to-all (us) | exposed (us) | exposed share |")
    print("|---|---|---|---|---|")
    for schedule in args.schedules.split(","):
        section = dataclasses.replace(config.schedule, name=schedule, profile=args.profile)
        report = plan_train_step(dataclasses.replace(config, schedule=section), mesh).report
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
