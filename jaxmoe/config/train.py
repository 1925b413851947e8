"""The train section: optimisation, checkpoints and gradient synchronisation."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmoe.config import choices
from jaxmoe.config.checks import (
    check_types,
    non_negative,
    positive_int,
    positive_or_none,
    require,
)

# ZeRO stages (train.zero): none, the distributed optimizer, fully sharded parameters.
ZERO_STAGES = (0, 1, 3)
# Why each gradient-sync algorithm but allreduce and bucketed does not compose with ZeRO,
# which reduce-scatters every gradient onto the shards of its parameter's replicas.
_NOT_WITH_ZERO = {
    "auto": "auto picks among algorithms that do not all shard gradients",
    "hierarchical": "its in-host reduce-scatter, cross-host sum and in-host gather end "
    "in whole gradients, not in the shards ZeRO updates",
    "int8": "its error-feedback residuals are kept for whole per-device gradient blocks "
    "and its quantised sums end in whole gradients",
    "decentralized": "its replicas keep parameters of their own (gossip), which cannot be "
    "shards of one parameter",
    "decentralized-int8": "its replicas keep parameters of their own (gossip), which cannot "
    "be shards of one parameter",
    "delayed": "its pending gradient is kept whole on every replica",
}


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation: batch, schedule (linear warm-up then cosine decay), AdamW, clipping."""

    batch_size: int = 32  # sequences per step, across all devices
    # Gradient accumulation inside the step: each device's rows in this many microbatches,
    # their gradients summed before one synchronisation and update (jaxmoe/train/
    # microbatches.py).
    microbatches: int = 1
    # Steps of the run.
    steps: int = 300
    # The peak learning rate, reached at the end of the warm-up.
    learning_rate: float = 3e-3
    # Steps of linear warm-up, from learning_rate / warmup_steps to learning_rate.
    warmup_steps: int = 20
    # The cosine decays to learning_rate * min_lr_ratio at the last step.
    min_lr_ratio: float = 0.1
    # AdamW's decoupled weight decay, on weight matrices (not on biases or norm scales).
    weight_decay: float = 0.1
    # AdamW's decay rate of the first moment.
    adam_b1: float = 0.9
    # AdamW's decay rate of the second moment.
    adam_b2: float = 0.95
    # The synchronised gradients are scaled down to this global norm where it is larger;
    # None: no clipping.
    grad_clip_norm: float | None = 1.0
    # Seed of the initial parameters, of the batches (each drawn from the seed and the
    # step) and of the router's noise.
    seed: int = 0
    # The validation loss is computed every this many steps and at the last step.
    eval_every: int = 50
    # Validation batches per evaluation.
    eval_batches: int = 4
    # Checkpoints (written under --out): every this many steps, and at the end of the run
    # and on SIGTERM/SIGINT; 0 = only at the end and on a signal.
    checkpoint_every: int = 100
    # The last this many checkpoints are kept.
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
    # auto: time this many steps of each algorithm whose estimated time to a loss is within
    # grad_sync_trial_margin of the best, on the run's own mesh, and pick by the measured
    # steps (jaxmoe/plan/grad_sync_trial.py); 0: the estimates alone decide.
    grad_sync_trial_steps: int = 0
    # auto with a trial: how far above the best estimate, as a fraction of it, an
    # algorithm's estimate may be and still be timed.
    grad_sync_trial_margin: float = 0.15
    # One device's dense peak TFLOP/s for the mfu metric; None: its datasheet's, if known.
    peak_tflops: float | None = None
    # ZeRO over the replicas of each parameter (jaxmoe/parallel/zero.py): 0 every replica
    # holds the whole float32 parameters, gradients and AdamW moments; 1 the distributed
    # optimizer (parameters, moments and reduced gradients sharded over the replicas, the
    # parameters gathered at the start of the step, gradients reduce-scattered); 3 fully
    # sharded (each block also gathers its parameters right before it runs, forward and
    # backward). Needs grad_sync allreduce or bucketed.
    zero: int = 0
    # The dtype the gradients are summed across replicas in: float32, or bfloat16 (half the
    # bytes on the wire, Megatron-Core's --grad-reduce-in-bf16; the sums are cast back to
    # float32 for the optimizer; under zero 3, each block's reduce-scatters in its backward
    # pass too). bfloat16 needs grad_sync allreduce, bucketed or hierarchical.
    grad_reduce_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_types("train", self)
        for name in ("batch_size", "microbatches", "steps", "eval_every", "eval_batches"):
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
            self.zero in ZERO_STAGES,
            f"train.zero={self.zero!r}: choose one of {', '.join(map(str, ZERO_STAGES))}",
        )
        require(
            not self.zero or self.grad_sync not in _NOT_WITH_ZERO,
            f"train.grad_sync={self.grad_sync} with train.zero={self.zero}: "
            f"{_NOT_WITH_ZERO.get(self.grad_sync)}; choose allreduce or bucketed",
        )
        require(
            isinstance(self.grad_sync_devices_per_host, int)
            and self.grad_sync_devices_per_host >= 0,
            f"train.grad_sync_devices_per_host={self.grad_sync_devices_per_host!r}: must be an "
            "integer >= 0 (0: each process is a host)",
        )
        require(
            isinstance(self.grad_sync_trial_steps, int) and self.grad_sync_trial_steps >= 0,
            f"train.grad_sync_trial_steps={self.grad_sync_trial_steps!r}: must be an integer "
            ">= 0 (0: no trial, the estimates decide)",
        )
        non_negative("train", "grad_sync_trial_margin", self.grad_sync_trial_margin)
        require(
            self.grad_reduce_dtype in choices.GRAD_REDUCE_DTYPES,
            f"train.grad_reduce_dtype={self.grad_reduce_dtype!r}: choose one of "
            f"{', '.join(choices.GRAD_REDUCE_DTYPES)}",
        )
        if self.grad_reduce_dtype != "float32":
            require(
                self.grad_sync in choices.REDUCE_AS_GIVEN,
                f"train.grad_reduce_dtype={self.grad_reduce_dtype} with train.grad_sync="
                f"{self.grad_sync}: that algorithm chooses its own wire format; use "
                f"{', '.join(choices.REDUCE_AS_GIVEN)}",
            )
