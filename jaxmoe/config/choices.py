"""The named choices of configuration fields (no JAX here: reading a config must not
import it)."""

DTYPES = ("float32", "bfloat16")
# What the backward pass recomputes instead of keeping: nothing, or the core attention
# (softmax(QK^T) V; Megatron-Core's selective recomputation).
RECOMPUTE = ("none", "attention")
# The policies of scheduling.SchedulePolicy (kept here so that reading a config does not
# import JAX; a test checks that the two agree).
SCHEDULES = (
    "none", "async", "dw", "partition", "lancet", "expert_pipeline", "comet", "lancet+comet"
)  # fmt: skip
SCHEDULE_PROFILES = (
    "a100", "v100", "cpu", "a100-8x-nvlink-400g", "v100-8x-nvlink-100g", "h100-8x-nvlink-3200g"
)  # fmt: skip
OP_COSTS = ("analytic", "measured")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
ON_NONFINITE = ("stop", "skip")
# How tokens reach the experts (jaxmoe/layers/dispatchers.py).
DISPATCHERS = ("all_to_all", "all_gather")
# The algorithms of jaxmoe.parallel.grad_sync, one module each.
GRAD_SYNCS = (
    "allreduce",
    "bucketed",
    "hierarchical",
    "int8",
    "decentralized",
    "decentralized-int8",
    "delayed",
)
# ``train.grad_sync`` may also be "auto": chosen from the cost model at start-up.
GRAD_SYNC_CHOICES = (*GRAD_SYNCS, "auto")
