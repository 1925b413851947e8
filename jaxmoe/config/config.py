"""Configuration: frozen dataclasses validated when they are built.

Every invalid value raises :class:`ConfigError` with one message that names the
field (as ``section.field``) and says how to fix it. Checks that need the
device count (the mesh must cover every device) live in
:func:`jaxmoe.parallel.mesh.build_mesh`, the one place that knows the devices.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from jaxmoe.config import choices

# ConfigError is part of this module's interface: raised by every check below.
from jaxmoe.config.checks import ConfigError as ConfigError
from jaxmoe.config.checks import (
    check_types,
    non_negative,
    one_of,
    positive_int,
    positive_or_none,
    require,
)
from jaxmoe.parallel.layout import LayoutError, check_layout, check_split_widths


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder whose FFN is a Mixture of Experts every ``moe_every`` layers."""

    vocab_size: int = 256
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    d_ff: int = 512
    seq_len: int = 128
    # Layers k-1, 2k-1, ... are MoE layers (Lancet and GShard use k = 2).
    moe_every: int = 2
    # Compute dtype of activations; parameters and the optimizer stay in float32.
    dtype: str = "float32"
    # The backward pass recomputes this instead of keeping its activations: "none", or
    # "attention" (softmax(QK^T) V, whose weights are O(seq^2) per head).
    recompute: str = "none"

    def __post_init__(self) -> None:
        check_types("model", self)
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "seq_len"):
            positive_int("model", name, getattr(self, name))
        positive_int("model", "moe_every", self.moe_every)
        require(
            self.moe_every <= self.num_layers,
            f"model.moe_every={self.moe_every} is larger than model.num_layers="
            f"{self.num_layers}: the model would have no MoE layer; use at most num_layers",
        )
        require(
            self.d_model % self.num_heads == 0,
            f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}: "
            "choose a width that is a multiple of the number of heads",
        )
        one_of("model", "dtype", self.dtype, choices.DTYPES)
        one_of("model", "recompute", self.recompute, choices.RECOMPUTE)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose FFN is a Mixture of Experts."""
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.moe_every == 0)


@dataclass(frozen=True)
class MoEConfig:
    """Routing and expert settings shared by every MoE layer."""

    num_experts: int = 8
    top_k: int = 1
    # Capacity per expert = ceil(group_size * top_k * capacity_factor / num_experts).
    # None selects dropless dispatch (no token is ever dropped).
    capacity_factor: float | None = 1.0
    # Tokens per routing group; capacity is counted per group (GShard). None = one sequence,
    # which keeps routing independent of how the batch is sharded.
    group_size: int | None = None
    score_function: str = "softmax"
    # Renormalise the top-k weights to sum to one. Ignored for top_k == 1, where it would
    # make every weight 1 and cut the router off from the task loss.
    normalize_top_k: bool = True
    aux_loss_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    # Multiplicative input noise U(1 - jitter, 1 + jitter) on the router during training.
    jitter: float = 0.0
    # Hidden width of each expert; None = model.d_ff.
    d_expert: int | None = None
    # Expert slots per device (None = experts per device); the spare slots hold replicas
    # placed by a runtime table (jaxmoe/parallel/placement.py). Capacity is per slot.
    slots_per_device: int | None = None
    # Re-plan the replicas every this many steps from the routing counts (0: static).
    rebalance_every: int = 0
    # jaxmoe/layers/dispatchers.py. all_to_all (default): bytes ~ tokens x top_k x capacity
    # factor (x expert_tensor); all_gather: tokens x (expert x expert_tensor - 1), so it wins
    # for small MoE groups, with expert_tensor > 1, and in dropless mode.
    dispatcher: str = "all_to_all"

    def __post_init__(self) -> None:
        check_types("moe", self)
        positive_int("moe", "num_experts", self.num_experts)
        positive_int("moe", "top_k", self.top_k)
        require(
            self.top_k <= self.num_experts,
            f"moe.top_k={self.top_k} is larger than moe.num_experts={self.num_experts}: "
            "a token cannot be sent to more experts than exist",
        )
        if self.capacity_factor is not None:
            require(
                isinstance(self.capacity_factor, int | float)
                and not isinstance(self.capacity_factor, bool)
                and self.capacity_factor > 0,
                f"moe.capacity_factor={self.capacity_factor!r}: must be > 0, "
                "or None for dropless routing",
            )
        if self.group_size is not None:
            positive_int("moe", "group_size", self.group_size)
        if self.d_expert is not None:
            positive_int("moe", "d_expert", self.d_expert)
        if self.slots_per_device is not None:
            positive_int("moe", "slots_per_device", self.slots_per_device)
        require(
            isinstance(self.rebalance_every, int) and self.rebalance_every >= 0,
            f"moe.rebalance_every={self.rebalance_every!r}: must be an integer >= 0 (0: static)",
        )
        one_of("moe", "dispatcher", self.dispatcher, choices.DISPATCHERS)
        one_of("moe", "score_function", self.score_function, choices.SCORE_FUNCTIONS)
        for name in ("aux_loss_coef", "z_loss_coef"):
            non_negative("moe", name, getattr(self, name))
        require(
            isinstance(self.jitter, int | float) and 0 <= self.jitter < 1,
            f"moe.jitter={self.jitter!r}: must be in [0, 1)",
        )

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None


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


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from."""

    # A text file, or a .bin of uint16 token ids; None = the Python standard library sources.
    path: str | None = None
    val_fraction: float = 0.05
    # Read at most this many bytes of the default corpus (None = all of it).
    max_bytes: int | None = 8_000_000

    def __post_init__(self) -> None:
        check_types("data", self)
        require(
            isinstance(self.val_fraction, float | int) and 0 < self.val_fraction < 1,
            f"data.val_fraction={self.val_fraction!r}: must be in (0, 1)",
        )
        if self.max_bytes is not None:
            positive_int("data", "max_bytes", self.max_bytes)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation: batch, schedule (linear warm-up then cosine decay), AdamW, clipping."""

    batch_size: int = 32  # sequences per step, across all devices
    steps: int = 300
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    # The cosine decays to learning_rate * min_lr_ratio at the last step.
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    grad_clip_norm: float | None = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    # How the scheduling layer rewrites the step: none (plain jit), async, dw,
    # partition (forward ranges chunked and pipelined), lancet (partition + dw),
    # expert_pipeline (Tutel-style: all-to-all and experts pipelined at a fixed degree).
    schedule: str = "none"
    # Device profile of the scheduler's cost model.
    schedule_profile: str = "a100"
    # Reductions smaller than this stay synchronous (and combinable by XLA).
    schedule_async_min_bytes: int = 0
    # Op costs for the scheduler: analytic (the profile) or measured on this backend.
    schedule_op_costs: str = "analytic"
    # Measured collective curves (experiments.collective_sweep) instead of the profile's link.
    schedule_link_curves: str | None = None
    # The cost model's link, in Mbit/s per device (0: the profile's own figure).
    schedule_link_mbit: float = 0.0
    # partition/lancet: chunk count to use (0: the search picks from 2..8; expert_pipeline:
    # its degree, required), and whether to
    # partition every range that can be, even where the estimate does not improve.
    schedule_partition_chunks: int = 0
    schedule_partition_always: bool = False
    # On the CPU backend across processes, run the scheduled all-to-alls over sockets
    # (scheduling.runtime.socket_all_to_all), where they overlap computation; XLA:CPU runs its own
    # async pairs synchronously. Ignored elsewhere.
    schedule_socket_all_to_all: bool = False
    # comet: decompose every MoE exchange this way ("rounds:G", "chunks:N") whatever the
    # estimate ("": the cost model chooses per layer).
    schedule_exchange: str = ""
    # Checkpoints (written under --out): every this many steps, and at the end of the run
    # and on SIGTERM/SIGINT; 0 = only at the end and on a signal. The last
    # keep_checkpoints are kept.
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    # A step whose loss or gradient norm is not finite: stop the run (its update is not
    # saved), or skip (drop that update, keep training, count it in the metrics).
    on_nonfinite: str = "stop"
    # How gradients are synchronised across replicas (jaxmoe/parallel/grad_sync/):
    # allreduce (exact), bucketed (fused psums), hierarchical (inside each host, then across
    # hosts), int8 (8-bit codes with error feedback), decentralized (ring gossip),
    # decentralized-int8 (ring gossip of 8-bit codes), delayed (one step stale), or auto
    # (the one the cost model estimates fastest on the link it is told).
    grad_sync: str = "allreduce"
    # bucketed, hierarchical, decentralized-int8: the largest bucket of fused gradients
    # (25 MiB, PyTorch DDP's default).
    grad_bucket_bytes: int = 25 * 2**20
    # hierarchical and auto: consecutive devices of the mesh (row-major) that form one host.
    # 0: each process is a host (one host in a single-process run).
    grad_sync_devices_per_host: int = 0
    # One device's dense peak TFLOP/s for the mfu metric; None: its datasheet's, if known.
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        check_types("train", self)
        for name in ("batch_size", "steps", "eval_every", "eval_batches"):
            positive_int("train", name, getattr(self, name))
        require(
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
            f"train.warmup_steps={self.warmup_steps!r}: must be an integer >= 0",
        )
        require(
            isinstance(self.learning_rate, int | float) and self.learning_rate > 0,
            f"train.learning_rate={self.learning_rate!r}: must be > 0",
        )
        require(
            isinstance(self.min_lr_ratio, int | float) and 0 <= self.min_lr_ratio <= 1,
            f"train.min_lr_ratio={self.min_lr_ratio!r}: must be in [0, 1]",
        )
        non_negative("train", "weight_decay", self.weight_decay)
        for name in ("adam_b1", "adam_b2"):
            value = getattr(self, name)
            require(0 <= value < 1, f"train.{name}={value!r}: must be in [0, 1)")
        positive_or_none("train", "grad_clip_norm", self.grad_clip_norm, "to disable")
        positive_or_none("train", "peak_tflops", self.peak_tflops, "for the device's datasheet")
        require(
            isinstance(self.seed, int) and self.seed >= 0,
            f"train.seed={self.seed!r}: must be an integer >= 0",
        )
        require(
            self.schedule in choices.SCHEDULES,
            f"train.schedule={self.schedule!r}: choose one of {', '.join(choices.SCHEDULES)}",
        )
        require(
            isinstance(self.schedule_async_min_bytes, int) and self.schedule_async_min_bytes >= 0,
            f"train.schedule_async_min_bytes={self.schedule_async_min_bytes!r}: must be an "
            "integer >= 0",
        )
        require(
            self.schedule_link_mbit >= 0,
            f"train.schedule_link_mbit={self.schedule_link_mbit!r}: must be >= 0 (0 keeps the "
            "profile's link)",
        )
        require(
            self.schedule_partition_chunks == 0 or 2 <= self.schedule_partition_chunks <= 8,
            f"train.schedule_partition_chunks={self.schedule_partition_chunks!r}: choose 2..8, "
            "or 0 to let the search choose",
        )
        require(
            self.schedule != "expert_pipeline" or self.schedule_partition_chunks,
            "train.schedule=expert_pipeline needs its degree: set train.schedule_partition_chunks "
            "to 2..8 (degree 1 is --schedule async)",
        )
        kind, _, pieces = self.schedule_exchange.partition(":")
        require(
            not self.schedule_exchange
            or (kind in ("rounds", "chunks") and pieces.isdigit() and int(pieces) >= 2),
            f"train.schedule_exchange={self.schedule_exchange!r}: write rounds:G (G the expert "
            "group) or chunks:N (N >= 2), or leave it empty for the cost model's choice",
        )
        require(
            not self.schedule_exchange or self.schedule in ("comet", "lancet+comet"),
            f"train.schedule_exchange applies to --schedule comet or lancet+comet, not "
            f"{self.schedule!r}",
        )
        require(
            self.schedule_op_costs in choices.OP_COSTS,
            f"train.schedule_op_costs={self.schedule_op_costs!r}: choose one of "
            f"{', '.join(choices.OP_COSTS)}",
        )
        require(
            isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
            f"train.checkpoint_every={self.checkpoint_every!r}: must be an integer >= 0 "
            "(0 saves only at the end of the run and on a stop signal)",
        )
        positive_int("train", "keep_checkpoints", self.keep_checkpoints)
        require(
            self.on_nonfinite in choices.ON_NONFINITE,
            f"train.on_nonfinite={self.on_nonfinite!r}: choose one of "
            f"{', '.join(choices.ON_NONFINITE)}",
        )
        require(
            self.grad_sync in choices.GRAD_SYNC_CHOICES,
            f"train.grad_sync={self.grad_sync!r}: choose one of "
            f"{', '.join(choices.GRAD_SYNC_CHOICES)}",
        )
        positive_int("train", "grad_bucket_bytes", self.grad_bucket_bytes)
        require(
            isinstance(self.grad_sync_devices_per_host, int)
            and self.grad_sync_devices_per_host >= 0,
            f"train.grad_sync_devices_per_host={self.grad_sync_devices_per_host!r}: must be an "
            "integer >= 0 (0: each process is a host)",
        )
        require(
            self.schedule_profile in choices.SCHEDULE_PROFILES,
            f"train.schedule_profile={self.schedule_profile!r}: choose one of "
            f"{', '.join(choices.SCHEDULE_PROFILES)}",
        )


@dataclass(frozen=True)
class Config:
    """Everything a run needs; cross-section constraints are checked here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
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
        tokens_per_device = self.tokens_per_device
        require(
            tokens_per_device % self.group_size == 0,
            f"moe.group_size={self.group_size} does not divide the {tokens_per_device} "
            "tokens per device (train.batch_size / token shards x model.seq_len): "
            "choose a divisor of it",
        )

    @property
    def tokens_per_device(self) -> int:
        rows = self.train.batch_size // self.parallel.batch_shards
        return rows * self.model.seq_len // self.parallel.tensor

    @property
    def group_size(self) -> int:
        """Tokens per routing group, with the default resolved: the slice of one sequence
        a device holds (the whole sequence without sequence parallelism)."""
        return self.moe.group_size or self.model.seq_len // self.parallel.tensor

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
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(values) - set(sections)
        require(not unknown, f"unknown config sections {sorted(unknown)}")
        defaults = cls()
        built = {}
        for name in sections:
            section_type = type(getattr(defaults, name))
            given = values.get(name, {})
            known = {item.name for item in dataclasses.fields(section_type)}
            unknown_fields = sorted(set(given) - known)
            require(
                not unknown_fields,
                f"unknown fields {', '.join(f'{name}.{f}' for f in unknown_fields)}: "
                f"{name} has {', '.join(sorted(known))}",
            )
            built[name] = section_type(**given)
        return cls(**built)


def capacity_per_expert(
    group_size: int, top_k: int, capacity_factor: float | None, num_experts: int
) -> int:
    """ceil(group_size * top_k * capacity_factor / num_experts); dropless: group_size.

    In dropless mode an expert can receive at most every token of the group once
    (a token's top-k experts are distinct), so ``group_size`` slots never drop.
    """
    if capacity_factor is None:
        return group_size
    return max(1, math.ceil(group_size * top_k * capacity_factor / num_experts))
