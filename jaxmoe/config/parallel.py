"""The parallel section: the attention and MoE layouts folded onto a pipeline stage's
devices, and the pipeline of stages around them."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmoe.config.checks import ConfigError, check_types, positive_int, require
from jaxmoe.config.model import ModelConfig
from jaxmoe.config.schedule import ScheduleConfig
from jaxmoe.config.train import TrainConfig
from jaxmoe.parallel.layout import LayoutError, check_layout

# Schedules whose rewrite assumes the microbatch loop that the pipeline replaces.
_SCHEDULES_NOT_WITH_PIPELINE = {
    "pair": "it pairs the microbatch scopes of the gradient-accumulation loop, which the "
    "pipeline's ticks replace (they already run one microbatch's forward pass beside "
    "another's backward pass)",
}


@dataclass(frozen=True)
class ParallelConfig:
    """The two parallel layouts folded onto the devices (jaxmoe/parallel/layout.py), and
    the pipeline (jaxmoe/train/pipeline.py).

    MoE layers: ``data x expert x expert_tensor`` devices (expert-data replicas,
    the expert group, each expert's hidden dimension split). Attention and dense
    layers: ``tensor``-way tensor (and sequence) parallelism over the same
    devices, data parallelism over the rest. Those are one pipeline stage's devices;
    ``pipeline`` stages of them hold the blocks in ``pipeline x virtual_stages`` chunks
    of consecutive layers (chunk ``v x pipeline + s`` on stage ``s``), and every stage
    reads the same rows.
    """

    data: int = 1
    expert: int = 8
    tensor: int = 1
    expert_tensor: int = 1
    # Pipeline stages (1: no pipeline), and chunks of layers per stage (1: the plain 1F1B
    # schedule, a stage's layers consecutive; more: the interleaved schedule).
    pipeline: int = 1
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        check_types("parallel", self)
        for name in ("data", "expert", "tensor", "expert_tensor", "pipeline", "virtual_stages"):
            positive_int("parallel", name, getattr(self, name))
        require(
            self.virtual_stages == 1 or self.pipeline > 1,
            f"parallel.virtual_stages={self.virtual_stages} needs parallel.pipeline > 1: "
            "virtual stages are chunks of a pipeline stage's layers",
        )
        try:
            check_layout(self.stage_devices, self.tensor, self.expert, self.expert_tensor)
        except LayoutError as error:
            raise ConfigError(str(error)) from None

    @property
    def stage_devices(self) -> int:
        """The devices of one pipeline stage (all of them without a pipeline)."""
        return self.data * self.expert * self.expert_tensor

    @property
    def num_devices(self) -> int:
        return self.pipeline * self.stage_devices

    @property
    def chunks(self) -> int:
        """The pipeline's chunks of consecutive layers (1 without a pipeline)."""
        return self.pipeline * self.virtual_stages

    @property
    def batch_shards(self) -> int:
        """Attention's data parallelism: the batch is split this many ways (the stages of
        a pipeline read the same rows)."""
        return self.stage_devices // self.tensor

    @property
    def token_shards(self) -> int:
        """Every device of a stage holds distinct tokens (its batch rows, its sequence
        slice)."""
        return self.stage_devices


def check_pipeline(
    parallel: ParallelConfig, model: ModelConfig, train: TrainConfig, schedule: ScheduleConfig
) -> None:
    """What a pipeline needs from the other sections (nothing without one): equal chunks
    of layers, alike at each position, and the options that compose with it."""
    if parallel.pipeline == 1:
        return
    chunks = f"parallel.pipeline x parallel.virtual_stages = {parallel.chunks}"
    require(
        model.num_layers % parallel.chunks == 0,
        f"model.num_layers={model.num_layers} does not split into {chunks} equal chunks: "
        "choose a number of layers that is a multiple of it, or fewer stages",
    )
    per_chunk = model.num_layers // parallel.chunks
    moe = set(model.moe_layers)
    for position in range(per_chunk):
        kinds = {c * per_chunk + position in moe for c in range(parallel.chunks)}
        require(
            len(kinds) == 1,
            f"model.moe_every={model.moe_every}, model.first_dense_layers="
            f"{model.first_dense_layers}: the {per_chunk}-layer chunks of {chunks} hold MoE "
            f"and dense blocks at position {position}, but every stage runs the same chunk "
            "code; choose a chunk length that is a multiple of moe_every, without leading "
            "dense layers",
        )
    require(
        not train.zero,
        f"train.zero={train.zero} with parallel.pipeline={parallel.pipeline}: ZeRO shards "
        "the blocks over their replicas, the pipeline stacks them by stage; the two layouts "
        "are not combined, so choose one of them",
    )
    why = _SCHEDULES_NOT_WITH_PIPELINE.get(schedule.name)
    require(
        why is None,
        f"schedule.name={schedule.name} with parallel.pipeline={parallel.pipeline}: {why}; "
        "choose another schedule",
    )
    require(
        not schedule.pair_microbatches,
        f"schedule.pair_microbatches with parallel.pipeline={parallel.pipeline}: "
        f"{_SCHEDULES_NOT_WITH_PIPELINE['pair']}; leave it off",
    )
