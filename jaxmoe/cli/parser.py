"""The command line's parser: subcommands, flags, and the configuration they describe.

Every configuration field is a flag named after it, ``--SECTION.FIELD VALUE``
(``--moe.top_k 2``, ``--moe.capacity_factor none``, ``--parallel.data 2``), set over a
configuration file (``--config FILE``: TOML, or a run's ``config.json``) set over a
preset (``--preset NAME``; ``tiny`` when neither is given, the defaults under a file
alone). A field of several values takes them one after another (``--data.sources
web.bin:3 code.bin:1``). The shortcuts ``--steps N``, ``--data FILE[:WEIGHT] ...`` and
``--schedule NAME`` set ``train.steps``, ``data.sources`` and ``schedule.name`` (a
shortcut and its field may both be given only with the same value). The configuration
is resolved here, once: :func:`resolve_config`. Flags are matched by their whole names
only. A usage error is one line and exit status 2; an unknown flag's names the closest
flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import scheduling.names
from jaxmoe import exit_codes
from jaxmoe.cli import convert_command, data_command, generate_command
from jaxmoe.config import Config, ConfigError, choices
from jaxmoe.config.checks import closest, field_types
from jaxmoe.config.data import DataSource, parse_sources
from jaxmoe.config.files import read_config_file
from jaxmoe.config.moe import EXPERIMENTAL_FIELDS as EXPERIMENTAL_MOE_FIELDS
from jaxmoe.config.schedule import (
    EXPERIMENTAL_FIELDS,
    EXPERIMENTAL_TRAIN_FIELDS,
    MOVED_TRAIN_FIELDS,
    RUN_FIELDS,
)
from jaxmoe.presets import PRESETS, preset

# Shortcut flags and the configuration field each one sets.
SHORTCUTS = {"steps": "train.steps", "data": "data.sources", "schedule": "schedule.name"}
# Fields that left their section's flags, and the flag that sets them now.
RENAMED_FIELDS = {"data.path": "--data.sources (or --data FILE)"}
# The preset of a command line that names neither a preset nor a configuration file.
DEFAULT_PRESET = "tiny"
# What argparse reads as a negative number, not a flag.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class _Parser(argparse.ArgumentParser):
    """argparse, but flags match by their whole names only (no prefixes), an unknown one
    is refused naming the closest flag, and a usage error is one line (no usage block)
    and exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self._given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, refusing an unknown flag here, where the (sub)command's flags are
        known."""
        self._given = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = self._unknown_flag(extras)
        if unknown:
            self.error(unknown)
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        # A misspelt required flag is reported as itself, not as the flag missing.
        if message.startswith(("the following arguments are required", "one of the arguments")):
            message = self._unknown_flag(self._given) or message
        self.exit(exit_codes.USAGE_ERROR, f"{self.prog}: error: {message}\n")

    def _unknown_flag(self, args: list[str]) -> str | None:
        """The line refusing the first flag of ``args`` this parser does not know, naming
        the closest one it does (None if every flag is known)."""
        known = [option for action in self._actions for option in action.option_strings]
        for arg in args:
            if arg == "--":
                return None
            flag = arg.split("=", 1)[0]
            if not flag.startswith("-") or flag == "-" or _NEGATIVE_NUMBER.match(flag):
                continue
            if flag in known:
                continue
            offered = [
                option
                for action in self._actions
                if action.help != argparse.SUPPRESS and not isinstance(action, _Renamed | _Removed)
                for option in action.option_strings
                if option.startswith("--")
            ]
            # The flag it abbreviates, if one alone, else the nearest spelling.
            extended = [option for option in offered if option.startswith(flag)]
            guess = extended[0] if len(extended) == 1 else closest(flag, offered)
            fix = f"did you mean {guess}?" if guess else f"see {self.prog} --help"
            return f"unrecognized argument {flag}: {fix}"
        return None


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _value_parser(annotation: Any) -> Callable[[Any], Any]:
    """A str -> value converter for a config field's type; ``X | None`` accepts 'none'.
    ``data.sources`` takes the list of its flag's values (:func:`_takes_list`)."""
    if annotation == tuple[DataSource, ...]:
        return parse_sources
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = (arg for arg in args if arg is not type(None))
        parse_inner = _value_parser(inner)
        return lambda text: None if text.lower() in ("none", "null") else parse_inner(text)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and str in args:
        return str  # schedule.profile: a name or a file on the command line
    if annotation is bool:
        return _parse_bool
    if annotation in (int, float, str):
        return annotation
    raise TypeError(f"no command-line parser for {annotation!r}")


def _takes_list(parse: Callable[[Any], Any]) -> bool:
    """Whether a field's flag takes several values (its parser reads their list)."""
    return parse is parse_sources


def override_fields() -> dict[str, tuple[str, str, Callable[[Any], Any]]]:
    """``'section.field' -> (section, field, parser)`` for every configuration field."""
    fields = {}
    run_fields = {f"schedule.{name}" for name in RUN_FIELDS}
    for section in dataclasses.fields(Config):
        section_type = type(getattr(Config(), section.name))
        hints = field_types(section_type)
        for field in dataclasses.fields(section_type):
            if f"{section.name}.{field.name}" in run_fields:
                continue
            fields[f"{section.name}.{field.name}"] = (
                section.name,
                field.name,
                _value_parser(hints[field.name]),
            )
    return fields


class _Renamed(argparse.Action):
    """A flag that was renamed: refused with the new name, before anything runs."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise ConfigError(f"{option_string} is now {self.help}: use that flag instead")


class _Removed(argparse.Action):
    """A flag that is no setting any more: refused with its hint, before anything runs."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise ConfigError(f"{option_string}: {self.const}")


def add_config_arguments(command: argparse.ArgumentParser, shortcuts: bool = True) -> None:
    """The preset, the configuration file, the shortcuts and one ``--SECTION.FIELD`` flag
    per config field."""
    command.add_argument(
        "--preset",
        choices=PRESETS,
        help=f"a named configuration (default: {DEFAULT_PRESET}, unless --config is given)",
    )
    command.add_argument(
        "--config",
        metavar="FILE",
        help="a configuration file (TOML, or a run's config.json), set over the preset "
        "(or the defaults); flags override it",
    )
    if shortcuts:
        command.add_argument("--steps", type=int, help="shortcut for --train.steps")
        command.add_argument(
            "--data",
            nargs="+",
            metavar="FILE[:WEIGHT]",
            help="the corpora and their weights (--data.sources): text files or .bin corpora",
        )
        command.add_argument(
            "--schedule", choices=scheduling.names.POLICIES, help="shortcut for --schedule.name"
        )
    overrides = command.add_argument_group("configuration overrides")
    for name, (_, _, parse) in override_fields().items():
        many = {"nargs": "+"} if _takes_list(parse) else {}
        overrides.add_argument(f"--{name}", dest=f"override:{name}", metavar="VALUE", **many)
    for old, new in RENAMED_FIELDS.items():
        command.add_argument(f"--{old}", action=_Renamed, help=new)
    for old, new in MOVED_TRAIN_FIELDS.items():
        command.add_argument(f"--train.{old}", action=_Renamed, help=f"--schedule.{new}")
    for old, hint in EXPERIMENTAL_TRAIN_FIELDS.items():
        command.add_argument(
            f"--train.{old}", action=_Removed, nargs="?", const=hint, help=argparse.SUPPRESS
        )
    refused = {**EXPERIMENTAL_FIELDS, **dict.fromkeys(RUN_FIELDS, "the run fills it in")}
    for name, hint in refused.items():
        command.add_argument(
            f"--schedule.{name}", action=_Removed, nargs="?", const=hint, help=argparse.SUPPRESS
        )
    for name, hint in EXPERIMENTAL_MOE_FIELDS.items():
        command.add_argument(
            f"--moe.{name}", action=_Removed, nargs="?", const=hint, help=argparse.SUPPRESS
        )


def add_process_arguments(command: argparse.ArgumentParser) -> None:
    """The flags of one process of a multi-process run."""
    cluster = command.add_argument_group("multi-process runs")
    cluster.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    cluster.add_argument("--num-processes", type=int)
    cluster.add_argument("--process-id", type=int)
    cluster.add_argument(
        "--distributed", choices=["auto"], help="detect the cluster (SLURM, MPI, ...)"
    )
    cluster.add_argument("--heartbeat-timeout", type=int, default=30, metavar="SECONDS")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxmoe", description="Mixture-of-Experts training in JAX.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser("train", help="train a preset, with overrides")
    add_config_arguments(train)
    train.add_argument("--out", help="directory for config.json, metrics.jsonl and the report")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    existing = train.add_mutually_exclusive_group()
    existing.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its last checkpoint"
    )
    existing.add_argument(
        "--overwrite", action="store_true", help="delete the run in --out first, start again"
    )
    train.add_argument("--profile-steps", metavar="A:B", help="trace steps A..B to DIR/tensorboard")
    add_process_arguments(train)
    train.add_argument(
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
    add_config_arguments(schedule)
    schedule.add_argument(
        "--out",
        help="directory for schedule_report.json, schedule_timeline.json/.png, step.stablehlo.txt",
    )
    schedule.add_argument("--trace", help="compare with the op times of a --profile-steps trace")

    plan = commands.add_parser("plan", help="estimate and rank every parallel mapping on N devices")
    add_config_arguments(plan, shortcuts=False)
    plan.add_argument("--devices", type=int, required=True, help="devices to map onto")
    plan.add_argument("--profile", required=True, help="the cost model's device profile")
    plan.add_argument(
        "--schedule",
        default=",".join(choices.PLANNED_SCHEDULES),
        help="schedules, comma-separated, each where it applies: the fastest counts",
    )
    plan.add_argument("--json", metavar="FILE", help="write the ranking as JSON")
    plan.add_argument("--verbose", action="store_true", help="why mappings were skipped")
    plan.add_argument("--no-cache", action="store_true", help="estimate afresh, keep nothing")
    plan.add_argument(
        "--time-limit",
        type=float,
        metavar="SECONDS",
        help="estimate no more mappings after this long: the best found, not proven the best",
    )
    plan.add_argument(
        "--top",
        type=int,
        default=10,
        help="the best mappings that fit to make sure of: the search stops once they are known",
    )
    plan.add_argument(
        "--gap",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="stop once no mapping left can be more than this fraction faster than the "
        "slowest of the --top best (default 0: those best exactly)",
    )
    plan.add_argument(
        "--jobs",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="worker processes tracing side by side (default: the cores, at most 8)",
    )
    plan.add_argument(
        "--trace-every-layer",
        action="store_true",
        help="trace each mapping's whole depth (default: two and three blocks, extrapolated)",
    )

    curves = commands.add_parser(
        "link-curves",
        help="time collectives on the mesh and fit the curves of --schedule.link_curves",
    )
    add_config_arguments(curves, shortcuts=False)
    curves.add_argument("--out", required=True, help="the curves file to write (JSON)")
    curves.add_argument("--source", default="this machine", help="where it was measured")
    curves.add_argument("--min-bytes", type=int, default=4096)
    curves.add_argument("--max-bytes", type=int, default=4 << 20)
    curves.add_argument("--repeats", type=int, default=5)
    curves.add_argument("--chain", type=int, default=4, help="collectives per timed program")
    add_process_arguments(curves)

    data = commands.add_parser("data", help="tokenize text, JSON lines or Parquet into a corpus")
    data_command.add_arguments(data)

    convert = commands.add_parser(
        "convert", help="Hugging Face checkpoints (Mixtral, Qwen-MoE) in and out of a run"
    )
    convert_command.add_arguments(convert, override_fields())

    generate = commands.add_parser(
        "generate", help="continue a prompt with a run's checkpoint (greedy or sampled)"
    )
    generate_command.add_arguments(generate)

    config = commands.add_parser(
        "config", help="print the configuration train would run, every field, as a --config file"
    )
    add_config_arguments(config)
    return parser


def _parse_override(name: str, text: str | list[str], parse: Callable[[Any], Any]) -> Any:
    try:
        return parse(text)
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError(f"--{name}: cannot read {text!r} as a value of this field") from None


def _flag_text(value: str | list[str]) -> str:
    """A flag's value(s) as the command line gave them."""
    return " ".join(value) if isinstance(value, list) else value


def _requested_values(args: argparse.Namespace) -> dict[str, Any]:
    """``'section.field' -> value`` for every override and shortcut flag given.

    A shortcut and its field flag must agree: ``--steps 3 --train.steps 5`` is refused.
    """
    texts = {
        key.removeprefix("override:"): text
        for key, text in vars(args).items()
        if key.startswith("override:") and text is not None
    }
    fields = override_fields()
    values = {name: _parse_override(name, text, fields[name][2]) for name, text in texts.items()}
    for shortcut, name in SHORTCUTS.items():
        given = getattr(args, shortcut, None)
        if given is None or (args.command == "plan" and shortcut == "schedule"):
            continue
        given = given if isinstance(given, list) else str(given)
        value = _parse_override(name, given, fields[name][2])
        if name in values and values[name] != value:
            raise ConfigError(
                f"--{shortcut} {_flag_text(given)} and --{name} {_flag_text(texts[name])} "
                "disagree: give only one of them"
            )
        values[name] = value
    return values


def config_name(args: argparse.Namespace) -> str:
    """What the configuration was made from, to name it: the preset, the file, or both."""
    if args.config is None:
        return args.preset or DEFAULT_PRESET
    return args.config if args.preset is None else f"{args.preset} + {args.config}"


def resolve_config(args: argparse.Namespace) -> Config:
    """The configuration of the command line: the preset (the defaults under a file
    alone), the file's fields over it, the flags over both; raises ConfigError on a bad
    name or value."""
    values: dict[str, dict[str, Any]] = {}
    if args.preset is not None or args.config is None:
        values = preset(args.preset or DEFAULT_PRESET).to_dict()
    if args.config is not None:
        try:
            given = read_config_file(args.config)
        except ConfigError as error:
            raise ConfigError(f"--config {error}") from None
        for section, fields in given.items():
            values.setdefault(section, {}).update(fields)
    requested = _requested_values(args)
    if args.command == "plan":  # the planner lays the model out itself; one device until then
        laid_out = sorted(name for name in requested if name.startswith("parallel."))
        if laid_out:
            raise ConfigError(f"--{laid_out[0]}: jaxmoe plan chooses the layout itself")
        values["parallel"] = {"data": 1, "expert": 1}
    for name, value in requested.items():
        section, field = name.split(".")
        values.setdefault(section, {})[field] = value
    return Config.from_dict(values)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed command line (``ConfigError`` for a renamed flag)."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    return args


def config_from_train_args(argv: Sequence[str]) -> Config:
    """The configuration that ``jaxmoe train ARGV`` would run (preset, file, flags)."""
    return resolve_config(parse(["train", *argv]))
