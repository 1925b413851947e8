"""The whole configuration: its sections, and the checks that span them.

Checks that need the device count (the mesh must cover every device) live in
:func:`jaxmoe.parallel.mesh.build_mesh`, the one place that knows the devices.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxmoe.config.checks import ConfigError, closest, field_types, refuse_unknown, require
from jaxmoe.config.data import DataConfig, saved_data_fields
from jaxmoe.config.layout import LayoutError, check_split_widths, contiguous_positions
from jaxmoe.config.model import ModelConfig
from jaxmoe.config.moe import MoEConfig, capacity_per_expert, saved_moe_fields, shared_width
from jaxmoe.config.parallel import ParallelConfig, check_pipeline
from jaxmoe.config.schedule import (
    DEFAULT_SCHEDULE,
    RUN_FIELDS,
    ScheduleConfig,
    refuse_moved_train_fields,
    saved_schedule_fields,
    schedule_section,
)
from jaxmoe.config.sizes import check_array_sizes
from jaxmoe.config.train import TrainConfig


@dataclass(frozen=True)
class Config:
    """Everything a run needs; cross-section constraints are checked here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    schedule: ScheduleConfig = DEFAULT_SCHEDULE

    def __post_init__(self) -> None:
        check_array_sizes(self.model, self.moe, self.train)
        moe, parallel, train = self.moe, self.parallel, self.train
        require(
            moe.num_experts % parallel.expert == 0,
            f"moe.num_experts={moe.num_experts} is not divisible by "
            f"parallel.expert={parallel.expert}: use a multiple of the expert axis size",
        )
        require(
            train.batch_size % parallel.batch_shards == 0,
            f"train.batch_size={train.batch_size} is not divisible by the "
            f"{parallel.batch_shards} batch shards (devices / (parallel.tensor x "
            "parallel.context)): "
            "use a multiple of it",
        )
        try:
            check_split_widths(
                tensor=parallel.tensor,
                expert_tensor=parallel.expert_tensor,
                seq_len=self.model.seq_len,
                num_heads=self.model.num_heads,
                context=parallel.context,
                d_ff=self.model.d_ff,
                d_expert=moe.d_expert or self.model.d_ff,
                d_expert_field="moe.d_expert" if moe.d_expert else "model.d_ff",
                kv_heads=self.model.kv_heads,
                d_shared=shared_width(self.model, moe) if moe.num_shared_experts else 0,
            )
        except LayoutError as error:
            raise ConfigError(str(error)) from None
        require(
            self.model.vocab_size >= 256 or bool(self.data.sources),
            f"model.vocab_size={self.model.vocab_size}: the default byte-level corpus "
            "needs at least 256",
        )
        per_host = train.grad_sync_devices_per_host
        require(
            per_host == 0 or parallel.num_devices % per_host == 0,
            f"train.grad_sync_devices_per_host={per_host} does not divide the "
            f"{parallel.num_devices} devices: choose a "
            "divisor, or 0 for one host per process",
        )
        local = moe.num_experts // parallel.expert
        require(
            moe.slots_per_device is None or moe.slots_per_device >= local,
            f"moe.slots_per_device={moe.slots_per_device} is fewer than the {local} experts per "
            "device (moe.num_experts / parallel.expert): use at least that many",
        )
        require(
            not moe.rebalance_every or self.replica_slots > 0,
            f"moe.rebalance_every={moe.rebalance_every} needs spare slots to place replicas in: "
            f"set moe.slots_per_device above the {local} experts per device",
        )
        plain = moe.dispatcher == "all_to_all" and parallel.expert_tensor == 1
        replicas = f"moe.slots_per_device={moe.slots_per_device} (replicas) needs moe.dispatcher"
        require(not self.replica_slots or plain, f"{replicas}=all_to_all, parallel.expert_tensor=1")
        require(
            moe.dropless_dispatch != "ragged" or parallel.expert_tensor == 1,
            f"moe.dropless_dispatch=ragged needs whole experts on each device, and "
            f"parallel.expert_tensor={parallel.expert_tensor} splits each expert's hidden "
            "dimension: set parallel.expert_tensor 1, or moe.dropless_dispatch padded",
        )
        require(
            parallel.context == 1 or self.model.sliding_window is None,
            f"parallel.context={parallel.context} with model.sliding_window="
            f"{self.model.sliding_window}: context parallelism runs full causal attention; "
            "train a sliding-window model with parallel.context 1",
        )
        self._check_routing_groups()
        self._check_microbatches()
        self._check_pairing()
        check_pipeline(self.parallel, self.model, self.train)

    def _check_microbatches(self) -> None:
        """A microbatch is whole rows of a device, and whole routing groups."""
        microbatches = self.train.microbatches
        rows = self.train.batch_size // self.parallel.batch_shards
        require(
            rows % microbatches == 0,
            f"train.microbatches={microbatches} does not divide the {rows} rows a device "
            "holds (train.batch_size / batch shards): choose a divisor of it",
        )
        group_rows = self.group_size // self.model.seq_len
        require(
            group_rows <= 1 or (rows // microbatches) % group_rows == 0,
            f"train.microbatches={microbatches}: a microbatch of {rows // microbatches} rows "
            f"would cut a routing group of {group_rows} rows (moe.group_size="
            f"{self.group_size}): choose fewer microbatches or smaller groups",
        )

    def _check_pairing(self) -> None:
        """A schedule that pairs microbatches has two to pair: several microbatches, or a
        pipeline's ticks."""
        schedule, microbatches = self.schedule, self.train.microbatches
        if not schedule.pairs_microbatches or microbatches > 1 or self.parallel.pipeline > 1:
            return
        field = (
            "schedule.name=pair"
            if schedule.name == "pair"
            else f"schedule.pair_microbatches=true (with schedule.name={schedule.name})"
        )
        raise ConfigError(
            f"{field} runs each microbatch's passes beside another's, but "
            f"train.microbatches={microbatches} gives it one: set train.microbatches to 2 or "
            "more (a divisor of the rows a device holds), or choose another schedule"
        )

    def _check_routing_groups(self) -> None:
        """A routing group lies inside a device's tokens, or (under context or tensor
        parallelism) is whole sequences of the rows a device holds: see ``moe.group_size``."""
        parallel = self.parallel
        group, seq_len, sequence = self.group_size, self.model.seq_len, parallel.sequence_shards
        rows = self.train.batch_size // parallel.batch_shards
        if sequence == 1:
            tokens = self.tokens_per_device
            require(
                tokens % group == 0,
                f"moe.group_size={group} does not divide the {tokens} tokens per device "
                "(train.batch_size / token shards x model.seq_len): choose a divisor of it",
            )
            return
        runs = contiguous_positions(seq_len, parallel.context, parallel.tensor)
        layout = " and ".join(
            f"parallel.{name}={getattr(parallel, name)}"
            for name in ("context", "tensor")
            if getattr(parallel, name) > 1
        )
        whole = group % seq_len == 0 and rows % (group // seq_len) == 0
        require(
            runs % group == 0 or whole,
            f"moe.group_size={group}: under {layout} a routing group must divide the runs of "
            f"{runs} consecutive positions a device holds of each row, or be whole sequences "
            f"(a multiple of model.seq_len={seq_len}) whose count divides the {rows} rows per "
            "device; leave it unset for one sequence",
        )

    @property
    def tokens_per_device(self) -> int:
        rows = self.train.batch_size // self.parallel.batch_shards
        return rows * self.model.seq_len // self.parallel.sequence_shards

    @property
    def group_size(self) -> int:
        """Tokens per routing group, with the default resolved: one whole sequence, in
        every layout."""
        return self.moe.group_size or self.model.seq_len

    @property
    def capacity_per_expert(self) -> int:
        """Slots per expert per routing group (dropless: every token of the group fits)."""
        return capacity_per_expert(
            self.group_size, self.moe.top_k, self.moe.capacity_factor, self.moe.num_experts
        )

    @property
    def replica_slots(self) -> int:
        """Spare expert slots per device, beyond its own experts (0: no placement table)."""
        local = self.moe.num_experts // self.parallel.expert
        return (self.moe.slots_per_device or local) - local

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON's types (lists for tuples): what a run saves, and what
        a saved configuration reads back equal to."""
        return _json_types(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Config:
        """The configuration of a nested dict, section -> field -> value: what ``to_dict``
        wrote, a configuration file's tables, a preset's. The fields it leaves out take the
        defaults. Every name and value is read by :func:`config_sections` first, then each
        section and the whole are validated."""
        given = config_sections(values)
        built = {}
        for name, section_type in section_types().items():
            fields = given.get(name, {})
            built[name] = schedule_section(fields) if name == "schedule" else section_type(**fields)
        return cls(**built)


def _json_types(value: Any) -> Any:
    """``value`` with every tuple a list, as it reads back from JSON."""
    if isinstance(value, dict):
        return {key: _json_types(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_types(item) for item in value]
    return value


def section_types() -> dict[str, type]:
    """Each section's name and the dataclass that holds it, in :class:`Config`'s order."""
    defaults = Config()
    return {item.name: type(getattr(defaults, item.name)) for item in dataclasses.fields(Config)}


def _settings(section_type: type) -> list[str]:
    return [
        item.name
        for item in dataclasses.fields(section_type)
        if not (section_type is ScheduleConfig and item.name in RUN_FIELDS)
    ]


def _read_value(annotation: Any, value: Any) -> Any:
    """A value as a field of type ``annotation`` takes it: ``"none"`` is None where the
    field may be None (as on the command line: TOML has no null), an integer is a float
    where the field is a float."""
    options = typing.get_args(annotation) or (annotation,)
    if type(None) in options and isinstance(value, str) and value.lower() in ("none", "null"):
        return None
    integer = isinstance(value, int) and not isinstance(value, bool)
    if integer and float in options and int not in options:
        return float(value)
    return value


def config_sections(values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The sections of a nested dict (section -> field -> value), read field by field
    before any section is built: every section a table of fields and every name known
    (ConfigError naming the closest known name otherwise), each value as its field takes
    it (:func:`_read_value`), the settings that left a section dropped at their old
    defaults or refused with where they went."""
    types = section_types()
    settings = {name: _settings(section_type) for name, section_type in types.items()}
    every = [f"{name}.{field}" for name, fields in settings.items() for field in fields]
    for name, section in values.items():
        if name not in types:  # a misspelt section, or a field outside its section
            guess = closest(name, types) or closest(name, every)
            fix = f"did you mean {guess}?" if guess else f"the sections are {', '.join(types)}"
            raise ConfigError(f"unknown section {name!r}: {fix}")
        require(
            isinstance(section, Mapping),
            f"{name}={section!r}: {name} is a section, a table of its fields ([{name}] in a "
            "configuration file)",
        )
    refuse_moved_train_fields(values.get("train", {}))
    read = {}
    for name, section in values.items():
        hints = field_types(types[name])
        fields = {
            field: _read_value(hints[field], value) if field in hints else value
            for field, value in section.items()
        }
        if name == "moe":
            fields = saved_moe_fields(fields)
        if name == "schedule":
            fields = saved_schedule_fields(fields)
        if name == "data":
            fields = saved_data_fields(fields)
        # The other sections' fields, read only to name the closest to an unknown one.
        elsewhere = (n for n in every if not n.startswith(f"{name}."))
        refuse_unknown(name, fields, settings[name], elsewhere)
        read[name] = fields
    return read
