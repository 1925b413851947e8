"""The names a user chooses from: policies, device profiles, op costs, transports.

No JAX here: a configuration is checked against these names before anything
imports JAX or compiles. With :mod:`scheduling.profiles` and :mod:`scheduling.policy`,
the bottom layer of the package (see the package's docstring).
"""

from __future__ import annotations

from pathlib import Path

# scheduling.policy.SchedulePolicy describes each one.
POLICIES = (
    "none", "async", "dw", "partition", "lancet", "expert_pipeline", "comet", "lancet+comet",
    "pair",
)  # fmt: skip
# Policies that partition forward ranges around the MoE layers, and that pack dW work.
PARTITIONING = frozenset({"partition", "lancet", "expert_pipeline", "lancet+comet"})
PACKING_DW = frozenset({"dw", "lancet", "pair"})
# Policies that may decompose an expert exchange (COMET).
DECOMPOSING = frozenset({"comet", "lancet+comet"})
# Policies that order two passes as one merge of their whole lengths
# (scheduling.passes.pair_microbatches): where a block's work runs depends on where the
# other pass ends, so a block's cost in the step depends on the passes' depth.
PAIRING = frozenset({"pair"})

# The name scope of a step's microbatch i (gradient accumulation inside one step): the
# ``pair`` policies run each microbatch's passes beside another microbatch's.
MICROBATCH_SCOPE = "microbatch_{}"
# The microbatches a step may have in flight: microbatch i's forward pass waits for
# microbatch i - 3's backward pass, the fewest that leave every policy's order possible
# (``pair`` runs forward i beside backward i - 2, once backward i - 3 has ended).
MICROBATCHES_IN_FLIGHT = 3
# The name scope of a pipelined step's tick i (one stage's forward slot and backward slot,
# of different microbatches): the ``pair`` policies run the two slots side by side.
TICK_SCOPE = "tick_{}"
# The name scope of the gathers of sharded weights before use (ZeRO-3): the scheduler
# starts each only as early as it takes to hide it (scheduling.passes.prefetch).
PARAMETER_GATHER_SCOPE = "param_gather"
# The name scope of ops that a target with a fused kernel for them runs as one kernel
# (an attention core, which cuDNN's flash attention computes in one): on a profile with
# ``fused_kernels`` the values made and read inside one such scope stay on chip
# (scheduling.costs.fusion).
ONE_KERNEL_SCOPE = "one_kernel"

# Multi-node cluster profiles are files (scheduling/profiles/NAME.json); three
# single-device profiles are written in scheduling/profiles.py.
PROFILE_DIRECTORY = Path(__file__).parent / "profiles"
SINGLE_DEVICE_PROFILES = ("a100", "v100", "cpu")
PROFILES = (
    *SINGLE_DEVICE_PROFILES,
    *sorted(path.stem for path in PROFILE_DIRECTORY.glob("*.json")),
)

# How op costs are found: FLOPs and bytes over the profile, or timed on this backend.
OP_COSTS = ("analytic", "measured")

# How the emitted program runs its collectives (scheduling.runtime.transports):
# XLA's async start/done pairs, or the scheduled order with synchronous collectives. (A
# transport of one's own, such as the emulated cluster's sockets, is an experimental
# option: scheduling.policy.ExperimentalOptions.transport.)
TRANSPORTS = ("xla", "sync")

# How the emitted program holds each scheduled window in place on XLA:GPU, whose scheduler
# otherwise orders the module itself: between optimization barriers (data dependences every
# XLA pass keeps), or not at all. scheduling.runtime.pinning. (XLA scheduling groups, which
# the XLA builds measured drop or mishandle, are ExperimentalOptions.xla_groups.)
XLA_PINS = ("barriers", "none")

# XLA flags under which the GPU compiler keeps a scheduled step's scheduled windows: the
# latency-hiding scheduler (off by default; without it an async pair with nothing between
# start and done becomes a synchronous collective); no dot merger, which otherwise fuses
# independent products that share an operand into one GEMM (seen on an H200: four products
# of one weight, in different windows and one after an all-to-all's done, became one),
# undoing the schedule's placement of each; and two collectives in flight at once (by default
# one: XLA closes a window before it opens the next), which a pinned step's compiles
# raise to its schedule's own count (:meth:`scheduling.runtime.pinning.Pinning.compiler_options`).
# All three exist in the XLA of jax 0.10.2 and 0.11.2 (an unknown flag stops XLA at start).
XLA_GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_dot_merger_threshold_mb=0",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
)
