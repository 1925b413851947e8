"""The schedule section: the scheduling layer's own policy, :class:`scheduling.SchedulePolicy`.

The section is the policy itself (``ScheduleConfig`` is its name here), checked by the
scheduling layer before anything imports JAX or compiles: :func:`schedule_section`
turns a bad value into one line naming ``schedule.FIELD`` and the fix. A run starts from
:data:`DEFAULT_SCHEDULE` (``none``: the step as written, plain jit); ``--schedule NAME``
is the shortcut for ``--schedule.name NAME``; the README's schedule table says what each
policy does. ``op_cost_cache`` is no setting: the run fills it in
(:func:`jaxmoe.train.scheduled.schedule_policy`).

Refused, each with a one-line hint: the old ``train.schedule_*`` fields (saved in a
configuration, or given as flags), and the research options that left the section
(``partition_always``, ``exchange``, ``link_mbit``, ``transport socket``, ``xla_pin
groups``): experiments pass those as :class:`scheduling.ExperimentalOptions` to the step
they build (:func:`jaxmoe.train.scheduled.scheduled_train_step`), and a link of one's own is a
profile file (``schedule.profile``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmoe.config.checks import ConfigError, check_types, refuse_unknown
from scheduling import DeviceProfile, PolicyError, SchedulePolicy

ScheduleConfig = SchedulePolicy
DEFAULT_SCHEDULE = SchedulePolicy(name="none")

# Fields the run fills in: not settings.
RUN_FIELDS = ("op_cost_cache",)

# Fields of the train section that the schedule section took over, by their new names.
MOVED_TRAIN_FIELDS = {
    "schedule": "name",
    "schedule_profile": "profile",
    "schedule_async_min_bytes": "async_min_bytes",
    "schedule_op_costs": "op_costs",
    "schedule_link_curves": "link_curves",
    "schedule_partition_chunks": "partition_chunks",
}

_EXPERIMENTAL = "experimental, no longer a setting: experiments pass it as"
_LINK = (
    "the cost model's link is its profile's: choose --schedule.profile, or write a profile "
    "file of your link (the JSON of scheduling/profiles/) and give its path"
)
# Research options that left the section (and their train.schedule_* forebears): the hint.
EXPERIMENTAL_FIELDS = {
    "partition_always": f"{_EXPERIMENTAL} scheduling.ExperimentalOptions(partition_always=True)",
    "exchange": f"{_EXPERIMENTAL} scheduling.ExperimentalOptions(exchange=...)",
    "link_mbit": _LINK,
}
EXPERIMENTAL_TRAIN_FIELDS = {
    "schedule_partition_always": EXPERIMENTAL_FIELDS["partition_always"],
    "schedule_exchange": EXPERIMENTAL_FIELDS["exchange"],
    "schedule_link_mbit": _LINK,
    "schedule_socket_all_to_all": (
        f"{_EXPERIMENTAL} scheduling.ExperimentalOptions(transport=...): the emulated "
        "cluster's socket transport is experiments/emulation/socket_transport.py"
    ),
}
# Values of the section's fields that are research options now.
EXPERIMENTAL_VALUES = {
    ("transport", "socket"): EXPERIMENTAL_TRAIN_FIELDS["schedule_socket_all_to_all"],
    ("xla_pin", "groups"): (
        f"{_EXPERIMENTAL} scheduling.ExperimentalOptions(xla_groups=True) (scheduling groups "
        "crash XLA:GPU of jax 0.10.2)"
    ),
}
# A saved section's research options at these values meant nothing: they are dropped.
_DROPPED_DEFAULTS: dict[str, Any] = {"partition_always": False, "exchange": None, "link_mbit": 0.0}


def refuse_experimental(field: str, value: Any) -> None:
    """Raise :class:`ConfigError` if ``schedule.FIELD=VALUE`` is a research option."""
    hint = EXPERIMENTAL_VALUES.get((field, value)) if isinstance(value, str) else None
    if field in EXPERIMENTAL_FIELDS or hint:
        raise ConfigError(f"schedule.{field}={value!r}: {hint or EXPERIMENTAL_FIELDS[field]}")


def refuse_moved_train_fields(train: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` for an old ``train.schedule_*`` field in ``train``."""
    for old in train:
        if old in MOVED_TRAIN_FIELDS:
            new = MOVED_TRAIN_FIELDS[old]
            raise ConfigError(
                f"train.{old} is now schedule.{new}: write it there (--schedule.{new})"
            )
        if old in EXPERIMENTAL_TRAIN_FIELDS:
            raise ConfigError(f"train.{old}: {EXPERIMENTAL_TRAIN_FIELDS[old]}")


def replace_section(section: SchedulePolicy, **fields: Any) -> SchedulePolicy:
    """``section`` with ``fields`` changed, checked as :func:`schedule_section` checks."""
    return schedule_section({**_fields(section), **fields})


def _fields(section: SchedulePolicy) -> dict[str, Any]:
    return {item.name: getattr(section, item.name) for item in dataclasses.fields(section)}


def saved_schedule_fields(values: dict[str, Any]) -> dict[str, Any]:
    """A given or saved section's settings: without the research options at their old
    defaults (every configuration written before they left) and the fields the run fills
    in, left unset (as ``to_dict`` writes them); a research option at another value, or a
    field the run fills in set, raises :class:`ConfigError` in one line."""
    values = {
        field: value
        for field, value in values.items()
        if not (field in _DROPPED_DEFAULTS and value == _DROPPED_DEFAULTS[field])
    }
    for field, value in values.items():
        refuse_experimental(field, value)
        if field in RUN_FIELDS and value is not None:
            raise ConfigError(f"schedule.{field}={value!r}: the run fills it in, not a setting")
    return {field: value for field, value in values.items() if field not in RUN_FIELDS}


def schedule_section(values: dict[str, Any]) -> SchedulePolicy:
    """The section from its fields (a saved or given subset; the rest are the defaults'),
    checked: ``ConfigError`` in one line for a bad value, an unknown field (naming the
    closest), a research option or a field the run fills in
    (:func:`saved_schedule_fields`)."""
    values = saved_schedule_fields(values)
    known = {item.name for item in dataclasses.fields(SchedulePolicy)} - set(RUN_FIELDS)
    refuse_unknown("schedule", values, known)
    profile = values.get("profile")
    if isinstance(profile, dict):  # a DeviceProfile, as to_dict wrote it
        values["profile"] = DeviceProfile(**profile)
    try:
        section = dataclasses.replace(DEFAULT_SCHEDULE, **values)
    except PolicyError as error:
        raise ConfigError(f"schedule.{error.field}={error.value!r}: {error.fix}") from None
    check_types("schedule", section)
    return section
