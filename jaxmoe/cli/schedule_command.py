"""``jaxmoe schedule``: plan the train step without training, and say what it does.

Prints the schedule report and the estimated MFU; with ``--out``, writes the report,
the simulated timeline (JSON, and PNG with matplotlib) and the step's StableHLO; with
``--trace``, sets the estimate beside a measured ``--profile-steps`` trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import scheduling
from jaxmoe.config import Config, ConfigError


def run(config: Config, args: argparse.Namespace) -> int:
    from jaxmoe.plan.grad_sync_choice import CHOICE_FILE
    from jaxmoe.plan.mfu import estimated_mfu
    from jaxmoe.prepare import prepare_run
    from jaxmoe.train.logs.profiler import compare_with_trace, find_trace
    from jaxmoe.train.scheduled import scheduled_train_step

    if config.schedule.name == "none":
        raise ConfigError(
            "--schedule none leaves the step as it is: choose async, dw, partition or lancet"
        )
    trace = None if args.trace is None else find_trace(args.trace)
    run = prepare_run(config)
    choice, mesh = run.grad_sync_choice, run.mesh
    if choice is not None:
        print(choice.table())
    planned = scheduled_train_step(run)
    print(planned.report.table())
    print(estimated_mfu(run.config, planned.report, mesh.devices.size).line())
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if choice is not None:
            choice.save(out / CHOICE_FILE)
        planned.report.save(out / "schedule_report.json")
        planned.report.save_trace(out / "schedule_timeline.json")
        if scheduling.gantt_available():
            planned.report.save_gantt(out / "schedule_timeline.png")
        else:
            print("matplotlib is not installed: no schedule_timeline.png (pip install .[plots])")
        (out / "step.stablehlo.txt").write_text(planned.stablehlo())
        print(
            "wrote schedule_report.json, schedule_timeline.json, schedule_timeline.png and "
            f"step.stablehlo.txt to {out}"
        )
    if trace is not None:
        print(compare_with_trace(planned, trace, args.out))
    return 0
