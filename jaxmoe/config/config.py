"""The whole configuration: its sections, and the checks that span them.

Checks that need the device count (the mesh must cover every device) live in
:func:`jaxmoe.parallel.mesh.build_mesh`, the one place that knows the devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jaxmoe.config.checks import ConfigError, require
from jaxmoe.config.data import DataConfig
from jaxmoe.config.layout import LayoutError, check_split_widths
from jaxmoe.config.model import ModelConfig
from jaxmoe.config.moe import MoEConfig, capacity_per_expert, saved_moe_fields, shared_width
from jaxmoe.config.parallel import ParallelConfig, check_pipeline
from jaxmoe.config.schedule import (
    DEFAULT_SCHEDULE,
    ScheduleConfig,
    refuse_moved_train_fields,
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
            f"{parallel.batch_shards} batch shards (devices / parallel.tensor): "
            "use a multiple of it",
        )
        try:
            check_split_widths(
                tensor=parallel.tensor,
                expert_tensor=parallel.expert_tensor,
                seq_len=self.model.seq_len,
                num_heads=self.model.num_heads,
                d_ff=self.model.d_ff,
                d_expert=moe.d_expert or self.model.d_ff,
                d_expert_field="moe.d_expert" if moe.d_expert else "model.d_ff",
                kv_heads=self.model.kv_heads,
                d_shared=shared_width(self.model, moe) if moe.num_shared_experts else 0,
            )
        except LayoutError as error:
            raise ConfigError(str(error)) from None
        require(
            self.model.vocab_size >= 256 or self.data.path is not None,
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
        self._check_routing_groups()
        self._check_microbatches()
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

    def _check_routing_groups(self) -> None:
        """A routing group lies inside a device's tokens, or (under tensor parallelism) is
        whole sequences of the rows a device holds: see ``moe.group_size``."""
        group, seq_len, tensor = self.group_size, self.model.seq_len, self.parallel.tensor
        rows = self.train.batch_size // self.parallel.batch_shards
        if tensor == 1:
            tokens = self.tokens_per_device
            require(
                tokens % group == 0,
                f"moe.group_size={group} does not divide the {tokens} tokens per device "
                "(train.batch_size / token shards x model.seq_len): choose a divisor of it",
            )
            return
        positions = seq_len // tensor
        whole = group % seq_len == 0 and rows % (group // seq_len) == 0
        require(
            positions % group == 0 or whole,
            f"moe.group_size={group}: under parallel.tensor={tensor} a routing group must "
            f"divide the {positions} positions a device holds of each row (model.seq_len / "
            f"parallel.tensor), or be whole sequences (a multiple of model.seq_len={seq_len}) "
            f"whose count divides the {rows} rows per device; leave it unset for one sequence",
        )

    @property
    def tokens_per_device(self) -> int:
        rows = self.train.batch_size // self.parallel.batch_shards
        return rows * self.model.seq_len // self.parallel.tensor

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
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        """The configuration ``to_dict`` wrote (one with an old ``train.schedule_*`` field is
        refused, naming the new one; a research option that left its section is dropped at
        the library's value and refused at any other, with its hint)."""
        values = {name: dict(section) for name, section in values.items()}
        refuse_moved_train_fields(values.get("train", {}))
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(values) - set(sections)
        require(not unknown, f"unknown config sections {sorted(unknown)}")
        defaults = cls()
        built = {}
        for name in sections:
            section_type = type(getattr(defaults, name))
            given = values.get(name, {})
            if name == "schedule":
                built[name] = schedule_section(given)
                continue
            if name == "moe":
                given = saved_moe_fields(given)
            known = {item.name for item in dataclasses.fields(section_type)}
            unknown_fields = sorted(set(given) - known)
            require(
                not unknown_fields,
                f"unknown fields {', '.join(f'{name}.{f}' for f in unknown_fields)}: "
                f"{name} has {', '.join(sorted(known))}",
            )
            built[name] = section_type(**given)
        return cls(**built)
