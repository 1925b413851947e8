"""The parallel section: the attention and MoE layouts folded onto a pipeline stage's
devices, and the pipeline of stages around them."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmoe.config.checks import ConfigError, check_types, one_of, positive_int, require
from jaxmoe.config.choices import CONTEXT_EXCHANGES
from jaxmoe.config.layout import LayoutError, check_layout
from jaxmoe.config.model import ModelConfig
from jaxmoe.config.train import TrainConfig


@dataclass(frozen=True)
class ParallelConfig:
    """The two parallel layouts folded onto the devices (jaxmoe/config/layout.py), and
    the pipeline (jaxmoe/pipeline/pipelined.py).

    MoE layers: ``data x expert x expert_tensor`` devices (expert-data replicas,
    the expert group, each expert's hidden dimension split). Attention and dense
    layers: ``tensor``-way tensor (and sequence) parallelism over the same
    devices, ``context``-way context parallelism (each sequence split, two load-balanced
    chunks a device) over the next ones, data parallelism over the rest. Those are one
    pipeline stage's devices;
    ``pipeline`` stages of them hold the blocks in ``pipeline x virtual_stages`` chunks
    of consecutive layers (chunk ``v x pipeline + s`` on stage ``s``), equal or as
    ``chunk_layers`` says, and every stage reads the same rows.
    """

    # MoE layers: expert-data replicas, each a copy of the expert group.
    data: int = 1
    # MoE layers: the expert group, the devices the experts are spread over.
    expert: int = 8
    # Attention and dense layers: tensor (and sequence) parallelism over this many
    # neighbouring devices, data parallelism over the rest of a stage's devices.
    tensor: int = 1
    # MoE layers: the devices each expert's hidden dimension is split over.
    expert_tensor: int = 1
    # Attention: each sequence split over this many devices (context parallelism), next
    # to the tensor group; they hold the same rows, each two chunks of their positions.
    context: int = 1
    # How a context group's keys and values reach every query: "ring" (blocks passed
    # around the group, one per step) or "all_gather" (all at once).
    context_exchange: str = "ring"
    # Pipeline stages (1: no pipeline).
    pipeline: int = 1
    # Chunks of layers per stage (1: the plain 1F1B schedule, a stage's layers
    # consecutive; more: the interleaved schedule).
    virtual_stages: int = 1
    # Layers per chunk, comma-separated in chunk order ("3,5"); none: equal chunks.
    chunk_layers: str | None = None

    def __post_init__(self) -> None:
        check_types("parallel", self)
        for name in (
            "data",
            "expert",
            "tensor",
            "expert_tensor",
            "context",
            "pipeline",
            "virtual_stages",
        ):
            positive_int("parallel", name, getattr(self, name))
        one_of("parallel", "context_exchange", self.context_exchange, CONTEXT_EXCHANGES)
        require(
            self.virtual_stages == 1 or self.pipeline > 1,
            f"parallel.virtual_stages={self.virtual_stages} needs parallel.pipeline > 1: "
            "virtual stages are chunks of a pipeline stage's layers",
        )
        try:
            check_layout(
                self.stage_devices, self.tensor, self.expert, self.expert_tensor, self.context
            )
        except LayoutError as error:
            raise ConfigError(str(error)) from None
        if self.chunk_layers is not None:
            counts = self.chunk_layer_counts
            require(
                self.pipeline > 1 and len(counts) == self.chunks,
                f"parallel.chunk_layers={self.chunk_layers!r}: name the layers of each of the "
                f"{self.chunks} chunks (pipeline x virtual_stages), e.g. "
                f"{','.join(['4'] * max(2, self.chunks))}, with parallel.pipeline > 1",
            )

    @property
    def chunk_layer_counts(self) -> tuple[int, ...] | None:
        """``chunk_layers`` as numbers (None: equal chunks); ConfigError if it is not a
        list of positive integers."""
        if self.chunk_layers is None:
            return None
        try:
            counts = tuple(int(part) for part in self.chunk_layers.split(","))
        except ValueError:
            counts = ()
        require(
            bool(counts) and min(counts) > 0,
            f"parallel.chunk_layers={self.chunk_layers!r}: write each chunk's layers as a "
            "positive integer, comma-separated in chunk order (e.g. 3,5)",
        )
        return counts

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
    def sequence_shards(self) -> int:
        """The devices holding the same rows, each its share of their positions: the
        context group times the tensor group."""
        return self.context * self.tensor

    @property
    def batch_shards(self) -> int:
        """Attention's data parallelism: the batch is split this many ways (the stages of
        a pipeline read the same rows)."""
        return self.stage_devices // self.sequence_shards

    @property
    def token_shards(self) -> int:
        """Every device of a stage holds distinct tokens (its batch rows, its sequence
        slice)."""
        return self.stage_devices


def check_pipeline(parallel: ParallelConfig, model: ModelConfig, train: TrainConfig) -> None:
    """What a pipeline needs from the other sections (nothing without one): chunks that
    cover the layers (equal ones unless ``chunk_layers`` says), alike at each position,
    and the options that compose with it."""
    if parallel.pipeline == 1:
        return
    require(
        model.mtp_depth == 0,
        f"model.mtp_depth={model.mtp_depth} with parallel.pipeline={parallel.pipeline}: the "
        "multi-token prediction modules are not pipelined; train them without a pipeline",
    )
    chunks = f"parallel.pipeline x parallel.virtual_stages = {parallel.chunks}"
    counts = parallel.chunk_layer_counts
    if counts is None:
        require(
            model.num_layers % parallel.chunks == 0,
            f"model.num_layers={model.num_layers} does not split into {chunks} equal chunks: "
            "choose a number of layers that is a multiple of it, fewer stages, or "
            "parallel.chunk_layers",
        )
        counts = (model.num_layers // parallel.chunks,) * parallel.chunks
    require(
        sum(counts) == model.num_layers,
        f"parallel.chunk_layers={parallel.chunk_layers!r} holds {sum(counts)} layers, the "
        f"model {model.num_layers}: the chunks must cover model.num_layers",
    )
    moe = set(model.moe_layers)
    offsets = [sum(counts[:c]) for c in range(parallel.chunks)]
    for position in range(max(counts)):
        kinds = {
            offsets[c] + position in moe for c in range(parallel.chunks) if position < counts[c]
        }
        require(
            len(kinds) == 1,
            f"model.moe_every={model.moe_every}, model.first_dense_layers="
            f"{model.first_dense_layers}: the chunks of {chunks} hold MoE and dense blocks at "
            f"position {position}, but every stage runs the same chunk code; choose chunks "
            "that start on a multiple of moe_every, without leading dense layers",
        )
    require(
        train.zero != 3,
        f"train.zero=3 with parallel.pipeline={parallel.pipeline}: fully sharded blocks "
        "gather their parameters inside the layer loop, which the pipeline's ticks replace; "
        "choose train.zero 1 (the distributed optimizer) or 0",
    )
