"""The parallel section: the attention and MoE layouts folded onto the devices."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmoe.config.checks import ConfigError, check_types, positive_int
from jaxmoe.parallel.layout import LayoutError, check_layout


@dataclass(frozen=True)
class ParallelConfig:
    """The two parallel layouts folded onto the devices (jaxmoe/parallel/layout.py).

    MoE layers: ``data x expert x expert_tensor`` devices (expert-data replicas,
    the expert group, each expert's hidden dimension split). Attention and dense
    layers: ``tensor``-way tensor (and sequence) parallelism over the same
    devices, data parallelism over the rest.
    """

    data: int = 1
    expert: int = 8
    tensor: int = 1
    expert_tensor: int = 1

    def __post_init__(self) -> None:
        check_types("parallel", self)
        for name in ("data", "expert", "tensor", "expert_tensor"):
            positive_int("parallel", name, getattr(self, name))
        try:
            check_layout(self.num_devices, self.tensor, self.expert, self.expert_tensor)
        except LayoutError as error:
            raise ConfigError(str(error)) from None

    @property
    def num_devices(self) -> int:
        return self.data * self.expert * self.expert_tensor

    @property
    def batch_shards(self) -> int:
        """Attention's data parallelism: the batch is split this many ways."""
        return self.num_devices // self.tensor

    @property
    def token_shards(self) -> int:
        """Every device holds distinct tokens (its batch rows, its sequence slice)."""
        return self.num_devices
