"""The ``jaxmoe`` command: parse, resolve the configuration once, run one subcommand.

``train``, ``schedule``, ``plan``, ``link-curves``, ``data``, ``convert``, ``generate``,
``config`` (the configuration printed as a file) and ``launch`` (N local processes of
``train``, for testing). A bad flag, value or input file prints one line and exits with
status 2, before anything compiles; each subcommand checks only what it uses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxmoe import exit_codes
from jaxmoe.cli import (
    config_command,
    convert_command,
    data_command,
    generate_command,
    link_curves_command,
    plan_command,
    schedule_command,
    train_command,
)
from jaxmoe.cli.parser import parse, resolve_config
from jaxmoe.config import Config, ConfigError
from jaxmoe.parallel.host_devices import ensure_host_devices, ensure_xla_flags, xla_flags_for
from jaxmoe.train.run_control import StopSignals

COMMANDS = {
    "train": train_command.run,
    "schedule": schedule_command.run,
    "plan": plan_command.run,
    "link-curves": link_curves_command.run,
    "data": data_command.run,
    "generate": generate_command.run,
    "convert": convert_command.run,
    "config": config_command.run,
}


def _check_layout(config: Config, processes: int) -> None:
    """The mesh's devices split evenly over the processes."""
    if config.parallel.num_devices % processes:
        raise ConfigError(
            f"parallel.data x parallel.expert x parallel.expert_tensor = "
            f"{config.parallel.num_devices} devices cannot be split evenly over "
            f"{processes} processes"
        )


def _check_input_files(config: Config, args: argparse.Namespace) -> None:
    """The files the subcommand reads, read and validated (imports JAX: call it last)."""
    from jaxmoe.cli.inputs import check_input_files, check_link_curves

    if args.command == "train":
        check_input_files(config)
    elif args.command == "schedule":
        check_link_curves(config.schedule)


def _devices_per_process(config: Config, args: argparse.Namespace) -> int:
    processes = 1
    if args.command in ("train", "link-curves"):
        processes = train_command.distributed_config(args).process_count_hint()
    _check_layout(config, processes)
    return config.parallel.num_devices // processes


def _launch(args: argparse.Namespace) -> int:
    from jaxmoe.cli.launch import launch

    if args.num_processes < 1:
        raise ConfigError(f"-n {args.num_processes}: launch at least one process")
    command_args = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
    if not command_args or command_args[0] != "train":
        raise ConfigError("usage: jaxmoe launch -n N -- train [ARGS]")
    # Everything each process would refuse, refused once here, before any is spawned.
    train_args = parse(command_args)
    config = resolve_config(train_args)
    _check_layout(config, args.num_processes)
    train_command.check_train_flags(train_args)
    _check_input_files(config, train_args)
    hint = None if train_args.out is None else "continue from its last checkpoint with --resume"
    return launch(command_args, args.num_processes, resume_hint=hint)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["train"]:
        return _main(argv)
    # A run's stop signals before anything heavy is imported: a signal while JAX and the
    # rest load (a second or more) ends it in one line with status 75, as later in its
    # start, not as an abort inside JAX's extension modules.
    with StopSignals():
        return _main(argv)


def _main(argv: list[str]) -> int:
    command = argv[0] if argv else "jaxmoe"
    try:
        args = parse(argv)
        if args.command == "launch":
            return _launch(args)
        if args.command in ("data", "convert", "generate"):  # no preset's configuration, no devices
            return COMMANDS[args.command](None, args)
        config = resolve_config(args)
        if args.command in ("plan", "config"):  # an abstract mesh, or none: no devices
            return COMMANDS[args.command](config, args)
        if args.command == "train":
            train_command.check_train_flags(args)
        # Before JAX creates its backends (at first use): the CPU platform's device count,
        # and what XLA:GPU needs of the run.
        ensure_host_devices(_devices_per_process(config, args))
        ensure_xla_flags(xla_flags_for(config))
        _check_input_files(config, args)
        return COMMANDS[args.command](config, args)
    except ConfigError as error:
        print(f"jaxmoe {command}: error: {error}", file=sys.stderr)
        return exit_codes.USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
