"""The ``jaxmoe`` command line.

``jaxmoe train`` runs a named preset with any configuration field overridden
by a flag named after it, ``--SECTION.FIELD VALUE`` (``--moe.top_k 2``,
``--moe.capacity_factor none``, ``--parallel.data 2``), plus the shortcuts
``--steps N``, ``--data FILE`` and ``--schedule NAME`` (a shortcut and its field
may both be given only with the same value). A bad flag, value or input file
prints one line and exits with status 2, before anything compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from jaxmoe import exit_codes
from jaxmoe.config import Config, ConfigError
from jaxmoe.config.choices import SCHEDULES
from jaxmoe.parallel.distributed import DistributedConfig
from jaxmoe.presets import PRESETS, preset

USAGE_ERROR = exit_codes.USAGE_ERROR
# Shortcut flags and the configuration field each one sets.
SHORTCUTS = {"steps": "train.steps", "data": "data.path", "schedule": "train.schedule"}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _value_parser(annotation: Any) -> Callable[[str], Any]:
    """A str -> value converter for a config field's type; ``X | None`` accepts 'none'."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = (arg for arg in args if arg is not type(None))
        parse_inner = _value_parser(inner)
        return lambda text: None if text.lower() in ("none", "null") else parse_inner(text)
    if annotation is bool:
        return _parse_bool
    if annotation in (int, float, str):
        return annotation
    raise TypeError(f"no command-line parser for {annotation!r}")


def _override_fields() -> dict[str, tuple[str, str, Callable[[str], Any]]]:
    """``'section.field' -> (section, field, parser)`` for every configuration field."""
    fields = {}
    for section in dataclasses.fields(Config):
        section_type = type(getattr(Config(), section.name))
        hints = typing.get_type_hints(section_type)
        for field in dataclasses.fields(section_type):
            fields[f"{section.name}.{field.name}"] = (
                section.name,
                field.name,
                _value_parser(hints[field.name]),
            )
    return fields


def _add_config_arguments(command: argparse.ArgumentParser, shortcuts: bool = True) -> None:
    """The preset, the shortcuts and one ``--SECTION.FIELD`` flag per config field."""
    command.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    if shortcuts:
        command.add_argument("--steps", type=int, help="shortcut for --train.steps")
        command.add_argument("--data", help="a text file or a .bin of uint16 ids (--data.path)")
        command.add_argument("--schedule", choices=SCHEDULES, help="shortcut for --train.schedule")
    overrides = command.add_argument_group("configuration overrides")
    for name in _override_fields():
        overrides.add_argument(f"--{name}", dest=f"override:{name}", metavar="VALUE")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxmoe", description="Mixture-of-Experts training in JAX.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser("train", help="train a preset, with overrides")
    _add_config_arguments(train)
    train.add_argument("--out", help="directory for config.json, metrics.jsonl and the report")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    existing = train.add_mutually_exclusive_group()
    existing.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint"
    )
    existing.add_argument(
        "--overwrite", action="store_true", help="delete the run in --out first, start again"
    )
    train.add_argument("--profile-steps", metavar="A:B", help="trace steps A..B to DIR/profile")
    cluster = train.add_argument_group("multi-process runs")
    cluster.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    cluster.add_argument("--num-processes", type=int)
    cluster.add_argument("--process-id", type=int)
    cluster.add_argument(
        "--distributed", choices=["auto"], help="detect the cluster (SLURM, MPI, ...)"
    )
    cluster.add_argument("--heartbeat-timeout", type=int, default=30, metavar="SECONDS")
    cluster.add_argument(
        "--step-timeout",
        type=float,
        metavar="SECONDS",
        help="end the process if a step hangs this long (default: 120 when multi-process)",
    )
    launch = commands.add_parser(
        "launch", help="start N processes of a command on this machine (for testing)"
    )
    launch.add_argument("-n", "--num-processes", type=int, required=True)
    launch.add_argument("command_args", nargs=argparse.REMAINDER, metavar="-- train ARGS")
    schedule = commands.add_parser(
        "schedule", help="schedule the train step without training, for inspection"
    )
    _add_config_arguments(schedule)
    schedule.add_argument(
        "--out",
        help="directory for schedule_report.json, schedule_timeline.json/.png, step.stablehlo.txt",
    )
    schedule.add_argument("--trace", help="compare with the op times of a --profile-steps trace")
    plan = commands.add_parser("plan", help="estimate and rank every parallel mapping on N devices")
    _add_config_arguments(plan, shortcuts=False)
    plan.add_argument("--devices", type=int, required=True, help="devices to map onto")
    plan.add_argument("--profile", required=True, help="the cost model's device profile")
    plan.add_argument(
        "--schedule", default="none", help="schedule(s), comma-separated: the fastest counts"
    )
    plan.add_argument("--json", metavar="FILE", help="write the ranking as JSON")
    plan.add_argument("--verbose", action="store_true", help="why mappings were skipped")
    plan.add_argument("--no-cache", action="store_true", help="estimate afresh, keep nothing")
    plan.add_argument(
        "--trace-every-layer",
        action="store_true",
        help="trace each mapping's whole depth (default: one and two blocks, extrapolated)",
    )
    return parser


def _parse_override(name: str, text: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(text)
    except ValueError:
        raise ConfigError(f"--{name}: cannot read {text!r} as a value of this field") from None


def _requested_values(args: argparse.Namespace) -> dict[str, Any]:
    """``'section.field' -> value`` for every override and shortcut flag given.

    A shortcut and its field flag must agree: ``--steps 3 --train.steps 5`` is refused.
    """
    texts = {
        key.removeprefix("override:"): text
        for key, text in vars(args).items()
        if key.startswith("override:") and text is not None
    }
    fields = _override_fields()
    values = {name: _parse_override(name, text, fields[name][2]) for name, text in texts.items()}
    for shortcut, name in SHORTCUTS.items():
        given = getattr(args, shortcut, None)
        if given is None:
            continue
        value = _parse_override(name, str(given), fields[name][2])
        if name in values and values[name] != value:
            raise ConfigError(
                f"--{shortcut} {given} and --{name} {texts[name]} disagree: give only one of them"
            )
        values[name] = value
    return values


def resolve_config(args: argparse.Namespace) -> Config:
    """The preset with every override applied; raises ConfigError on a bad value."""
    values = preset(args.preset).to_dict()
    requested = _requested_values(args)
    if args.command == "plan":  # the planner lays the model out itself; one device until then
        laid_out = sorted(name for name in requested if name.startswith("parallel."))
        if laid_out:
            raise ConfigError(f"--{laid_out[0]}: jaxmoe plan chooses the layout itself")
        values["parallel"] = {"data": 1, "expert": 1}
    for name, value in requested.items():
        section, field = name.split(".")
        values[section][field] = value
    return Config.from_dict(values)


def config_from_train_args(argv: Sequence[str]) -> Config:
    """The configuration that ``jaxmoe train ARGV`` would run (preset plus overrides)."""
    return resolve_config(_build_parser().parse_args(["train", *argv]))


def ensure_host_devices(count: int) -> None:
    """Give the CPU platform ``count`` devices unless XLA_FLAGS already sets it.

    Must run before JAX creates its backends. It only shapes the CPU (host) platform, so
    on a GPU machine the GPUs stay the devices a run uses.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _distributed_config(args: argparse.Namespace) -> DistributedConfig:
    return DistributedConfig(
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        auto=args.distributed == "auto",
        heartbeat_timeout_s=args.heartbeat_timeout,
    )


def _checkpoint_bytes(config: Config) -> int:
    """Bytes of one checkpoint: the whole train state (shapes only, nothing allocated)."""
    import jax

    from jaxmoe.train.state import abstract_train_state

    leaves = jax.tree.leaves(abstract_train_state(config))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def _prepare_out(args: argparse.Namespace, distributed: DistributedConfig) -> None:
    """Check ``--out`` (and clear it for ``--overwrite``) before JAX starts."""
    from jaxmoe.cli.run_dir import prepare_run_dir

    if args.out is None:
        if args.resume or args.overwrite:
            raise ConfigError("--resume and --overwrite need --out, the run's directory")
        return
    prepare_run_dir(
        args.out,
        resume=args.resume,
        overwrite=args.overwrite,
        primary=distributed.process_index_hint() == 0,
    )


def _resume_point(config: Config, args: argparse.Namespace) -> int | None:
    """Room for a checkpoint, and the checkpoint to resume from (after JAX starts)."""
    import jax

    from jaxmoe.cli.run_dir import check_free_space, resume_point

    if args.out is None:
        return None
    check_free_space(args.out, _checkpoint_bytes(config))
    if not args.resume:
        return None
    start = resume_point(args.out, config)
    if jax.process_index() == 0:
        if start.resume_step is None:
            print(f"--resume: no checkpoint in {args.out}: starting a new run", flush=True)
        elif start.changed_fields:
            print(
                f"--resume: continuing the checkpoint of step {start.resume_step} with other "
                f"values of {', '.join(start.changed_fields)}",
                flush=True,
            )
    return start.resume_step


def _train(config: Config, args: argparse.Namespace) -> int:
    import jax
    from absl import logging as absl_logging

    from jaxmoe.parallel.distributed import initialize
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.plan.grad_sync_choice import resolve_grad_sync
    from jaxmoe.train.loop import RunStopped, train
    from jaxmoe.train.profiler import parse_profile_steps

    profile = args.profile_steps
    if profile is not None:  # checked before anything starts or compiles
        profile = parse_profile_steps(profile, config.train.steps, args.out)

    # Orbax logs through absl, a failed background write as tracebacks from several
    # threads; the run reports each failure in one line of its own.
    absl_logging.set_verbosity(absl_logging.FATAL)
    distributed = _distributed_config(args)
    _prepare_out(args, distributed)
    initialize(distributed)  # before anything starts JAX's backends
    # Before the resume check: a checkpoint's gradient-sync state fits one algorithm.
    config, choice = resolve_grad_sync(config, build_mesh(config.parallel))
    resume_step = _resume_point(config, args)
    step_timeout = args.step_timeout
    if step_timeout is None and distributed.enabled:
        step_timeout = 120.0
    try:
        rows = train(
            config,
            args.out,
            progress=not args.no_progress,
            step_timeout_s=step_timeout,
            resume=resume_step is not None,
            profile_steps=profile,
            grad_sync_choice=choice,
        )
    except RunStopped as stopped:
        if jax.process_index() == 0:
            print(f"jaxmoe train: {stopped}", file=sys.stderr, flush=True)
        return stopped.status
    if jax.process_index() != 0:
        return 0
    if not rows:
        print(f"done: the run already has its {config.train.steps} steps")
        return 0
    last = rows[-1]
    print(
        f"done: {last['step'] + 1} steps ({len(rows)} in this run), "
        f"loss {rows[0]['loss']:.3f} -> {last['loss']:.3f}, "
        f"val_loss {last.get('val_loss', float('nan')):.3f}"
    )
    return 0


def _schedule(config: Config, args: argparse.Namespace) -> int:
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.plan.grad_sync_choice import CHOICE_FILE, resolve_grad_sync
    from jaxmoe.train.mfu import estimated_mfu
    from jaxmoe.train.profiler import compare_with_trace, find_trace
    from jaxmoe.train.scheduled import plan_train_step
    from scheduling.reports import gantt

    if config.train.schedule == "none":
        raise ConfigError(
            "--schedule none leaves the step as it is: choose async, dw, partition or lancet"
        )
    trace = None if args.trace is None else find_trace(args.trace)
    mesh = build_mesh(config.parallel)
    config, choice = resolve_grad_sync(config, mesh)
    if choice is not None:
        print(choice.table())
    planned = plan_train_step(config, mesh)
    print(planned.report.table())
    print(estimated_mfu(config, planned.report, mesh.devices.size).line())
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if choice is not None:
            choice.save(out / CHOICE_FILE)
        planned.report.save(out / "schedule_report.json")
        planned.report.save_trace(out / "schedule_timeline.json")
        if gantt.available():
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


def _plan(config: Config, args: argparse.Namespace) -> int:
    from jaxmoe.plan import plan_table, planner

    schedules = [name.strip() for name in args.schedule.split(",") if name.strip()]
    if args.json is not None:
        folder = Path(args.json).parent
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            raise ConfigError(f"--json {args.json}: {folder} is not a writable directory")
    result = planner.plan_mappings(
        config,
        args.preset,
        args.devices,
        args.profile,
        schedules,
        cache_dir=None if args.no_cache else planner.default_cache_dir(),
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        extrapolate_layers=not args.trace_every_layer,
    )
    print(plan_table.table(result, verbose=args.verbose))
    if args.json is not None:
        command = "jaxmoe " + shlex.join(args.argv)
        Path(args.json).write_text(json.dumps(result.to_json(command), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from jaxmoe.cli.launch import launch

    if args.num_processes < 1:
        raise ConfigError(f"-n {args.num_processes}: launch at least one process")
    command_args = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
    if not command_args or command_args[0] != "train":
        raise ConfigError("usage: jaxmoe launch -n N -- train [ARGS]")
    # Everything each process would refuse, refused once here, before any is spawned.
    train_args = _build_parser().parse_args(command_args)
    config = resolve_config(train_args)
    _check_layout(config, args.num_processes)
    _check_train_flags(train_args)
    _check_input_files(config)
    hint = None if train_args.out is None else "continue from its last checkpoint with --resume"
    return launch(command_args, args.num_processes, resume_hint=hint)


def _check_layout(config: Config, processes: int) -> None:
    """The mesh's devices split evenly over the processes."""
    if config.parallel.num_devices % processes:
        raise ConfigError(
            f"parallel.data x parallel.expert = {config.parallel.num_devices} devices cannot "
            f"be split evenly over {processes} processes"
        )


def _check_train_flags(args: argparse.Namespace) -> None:
    """The ``jaxmoe train`` flags that are not configuration fields."""
    timeout = args.step_timeout
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"--step-timeout {timeout:g}: must be a number of seconds > 0")
    _distributed_config(args)  # checks --heartbeat-timeout and the cluster flags


def _check_input_files(config: Config) -> None:
    """Every file the configuration names, read and validated (imports JAX: call it last)."""
    from jaxmoe.cli.inputs import check_input_files

    check_input_files(config)


def _devices_per_process(config: Config, args: argparse.Namespace) -> int:
    processes = _distributed_config(args).process_count_hint() if args.command == "train" else 1
    _check_layout(config, processes)
    return config.parallel.num_devices // processes


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "launch":
            return _launch(args)
        command = {"train": _train, "schedule": _schedule, "plan": _plan}[args.command]
        config = resolve_config(args)
        if args.command == "plan":  # traces on an abstract mesh: no devices needed
            return command(config, args)
        if args.command == "train":
            _check_train_flags(args)
        # Before JAX creates its backends (at first use): the CPU platform's device count.
        ensure_host_devices(_devices_per_process(config, args))
        _check_input_files(config)
        return command(config, args)
    except ConfigError as error:
        print(f"jaxmoe {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
