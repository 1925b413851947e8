"""The named choices of configuration fields (no JAX here: reading a config must not
import it). The schedule section's choices are the scheduling layer's own
(:mod:`scheduling.names`)."""

DTYPES = ("float32", "bfloat16")
# FP8 training's scaling of the GEMM operands (jaxmoe/layers/fp8.py): off, one scale per
# operand, or DeepSeek-V3's 1 x 128 activation tiles and 128 x 128 weight blocks.
FP8_RECIPES = ("none", "tensorwise", "blockwise")
# What the backward pass recomputes instead of keeping, least first: nothing, the dense
# core attention (softmax(QK^T) V; Megatron-Core's selective recomputation), everything
# but the matmuls' and the exchanges' results (MaxText's "minimal"; "matmuls_offload"
# keeps those in host memory), or each whole block from its input (full recomputation).
RECOMPUTE = ("none", "attention", "matmuls", "matmuls_offload", "layer")
ATTENTION = ("auto", "blockwise", "cudnn", "dense")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
ROPE_SCALINGS = ("none", "linear", "yarn")
ACTIVATIONS = ("gelu", "swiglu")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
ON_NONFINITE = ("stop", "skip")
# How a context group exchanges keys and values (jaxmoe/layers/context_attention.py):
# blocks passed around the ring, or all gathered at once.
CONTEXT_EXCHANGES = ("ring", "all_gather")
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
# The dtype gradients are summed across replicas in (Megatron-Core's --grad-reduce-in-bf16),
# and the algorithms that sum them as they are (the others choose their own wire format).
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")
REDUCE_AS_GIVEN = ("allreduce", "bucketed", "hierarchical")

# The schedules jaxmoe plan estimates each mapping under (where each applies) unless told:
# async and partition are parts of dw and lancet; comet and expert_pipeline are research
# policies.
PLANNED_SCHEDULES = ("none", "dw", "lancet", "pair")
