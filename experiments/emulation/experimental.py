"""The research options of the experiments' runs, as flags beside ``jaxmoe train``'s.

They are no settings of a configuration (``jaxmoe train`` refuses them): an experiment
takes them with its own flags and hands them to what it runs.

- ``--experimental.transport socket``: every all-to-all over the socket transport
  (:mod:`experiments.emulation.socket_transport`), ``none`` too (synchronously), so that a
  speedup over ``none`` is overlap, not a change of transport;
- ``--experimental.link_mbit X``: the emulated link's rate, told to the cost model (the
  configuration's profile with that link, written as a profile file: :func:`link_profile`)
  and bounding how long a socket done waits;
- ``--experimental.partition_always true``, ``--experimental.exchange rounds:G|chunks:N``,
  ``--experimental.xla_groups true``: as :class:`scheduling.ExperimentalOptions` says.

:meth:`Experimental.split` takes them off a list of ``jaxmoe train`` flags,
:meth:`Experimental.configure` gives a configuration the link, :meth:`Experimental.options`
is what the train step gets (``jaxmoe.train.scheduled.scheduled_train_step(...,
experimental=...)``), and :meth:`Experimental.argv` writes them back as flags (for a host
program's command line).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxmoe.config import Config, ConfigError

PREFIX = "--experimental."
TRANSPORTS = ("xla", "socket")


@dataclass(frozen=True)
class Experimental:
    """The research options of one run (the defaults change nothing)."""

    transport: str = "xla"  # "socket": the all-to-alls over the socket transport
    link_mbit: float = 0.0  # the emulated link's rate (0: the profile's link)
    partition_always: bool = False
    exchange: str | None = None
    xla_groups: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(
                f"{PREFIX}transport={self.transport!r}: choose one of {', '.join(TRANSPORTS)}"
            )
        if self.link_mbit < 0:
            raise ConfigError(f"{PREFIX}link_mbit={self.link_mbit!r}: must be >= 0")

    @classmethod
    def split(cls, argv: Sequence[str]) -> tuple[list[str], Experimental]:
        """``argv`` without its ``--experimental.NAME VALUE`` flags, and what they set."""
        rest, given = [], {}
        fields = {item.name: item for item in dataclasses.fields(cls)}
        items = list(argv)
        while items:
            flag = items.pop(0)
            if not flag.startswith(PREFIX):
                rest.append(flag)
                continue
            name = flag.removeprefix(PREFIX)
            if name not in fields:
                raise ConfigError(f"{flag}: unknown; the options are {', '.join(fields)}")
            if not items:
                raise ConfigError(f"{flag}: give it a value")
            given[name] = _parse(name, items.pop(0))
        return rest, cls(**given)

    def argv(self) -> list[str]:
        """The flags that give these options (none for a default)."""
        flags = []
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if value != item.default:
                flags += [f"{PREFIX}{item.name}", _text(value)]
        return flags

    def configure(self, config: Config) -> Config:
        """``config`` whose cost model is told the link (its profile, with the link's rate)."""
        if not self.link_mbit:
            return config
        profile = link_profile(config.schedule.profile, self.link_mbit)
        schedule = dataclasses.replace(config.schedule, profile=profile)
        return dataclasses.replace(config, schedule=schedule)

    def options(self) -> Any:
        """The :class:`scheduling.ExperimentalOptions` of the train step (None: none set)."""
        if self.transport == "xla" and self == Experimental(link_mbit=self.link_mbit):
            return None  # the link alone is the configuration's (its profile)
        import scheduling

        transport = None
        if self.transport == "socket":
            from experiments.emulation.socket_transport import socket_all_to_alls

            transport = socket_all_to_alls(self.link_mbit or None)
        return scheduling.ExperimentalOptions(
            partition_always=self.partition_always,
            exchange=self.exchange,
            xla_groups=self.xla_groups,
            transport=transport,
        )


def experimental_config(argv: Sequence[str]) -> tuple[Config, Experimental]:
    """The configuration ``jaxmoe train ARGV`` would run, with the research options among
    ``argv`` taken off it (the link given to its profile), and those options."""
    from jaxmoe.cli.parser import config_from_train_args

    train_argv, experimental = Experimental.split(argv)
    return experimental.configure(config_from_train_args(train_argv)), experimental


def saved_config(values: dict, flags: Sequence[str] = ()) -> tuple[Config, Experimental]:
    """A configuration as a results file saved it (``Config.to_dict``), with the research
    options of its run (``flags``, as the results file records them; in a configuration
    saved while they were schedule fields, those fields), the link told to its profile."""
    values = {name: dict(section) for name, section in values.items()}
    schedule = values.get("schedule", {})
    old: dict[str, Any] = {}
    if schedule.get("transport") == "socket":
        schedule["transport"], old["transport"] = "xla", "socket"
    if schedule.get("xla_pin") == "groups":
        schedule["xla_pin"], old["xla_groups"] = "barriers", True
    for name in ("link_mbit", "partition_always", "exchange"):
        value = schedule.pop(name, None)
        if value:
            old[name] = value
    _, given = Experimental.split(flags)
    experimental = dataclasses.replace(given, **old)
    return experimental.configure(Config.from_dict(values)), experimental


def link_profile(profile: Any, link_mbit: float) -> str:
    """A profile file: ``profile`` (a name, a profile file or a ``DeviceProfile``) with its
    link at ``link_mbit`` Mbit/s per device, written once (under the temporary directory,
    named for both) for the processes of a run on this machine to read."""
    import scheduling

    base = scheduling.SchedulePolicy(profile=profile).device_profile
    linked = base.with_link(link_mbit * 1e6 / 8)
    name = f"{Path(base.name).stem}-{link_mbit:g}mbit"
    path = Path(tempfile.gettempdir()) / "jaxmoe-emulated-links" / f"{name}.json"
    data = {**dataclasses.asdict(linked), "name": name, "description": f"{base.name}, emulated"}
    text = json.dumps(data, indent=1) + "\n"
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{id(text)}.tmp")
        partial.write_text(text)
        partial.replace(path)
    return str(path)


def _parse(name: str, text: str) -> Any:
    if name in ("partition_always", "xla_groups"):
        if text.lower() not in ("true", "false"):
            raise ConfigError(f"{PREFIX}{name} {text!r}: true or false")
        return text.lower() == "true"
    if name == "link_mbit":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{PREFIX}link_mbit {text!r}: a number of Mbit/s") from None
    if name == "exchange":
        return None if text.lower() == "none" else text
    return text


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)
