"""The options a mapping adds to its layout: the ZeRO stage, what the backward pass
recomputes, and the microbatches of a step. Each trades step time for memory per device;
the planner tries every set of them on every layout (no JAX here).

Ordered from least to most work: ZeRO 0, 1, 3 (``train.zero``: each stage shards more
of the state and gathers more parameters), recomputation ``none``, ``attention``,
``matmuls``, ``layer`` (``model.recompute``; :data:`PLANNED_RECOMPUTE`: the
recomputations the bounds cover, in jaxmoe.config.choices.RECOMPUTE's order;
``matmuls_offload`` is not searched: the cost model prices its copies to and from host
memory as copies within the device's memory, far faster than the host link), one
microbatch or more (``train.microbatches``: each one more pass over every layer's ops).
The set of least memory is the last stage and the last recomputation, in one microbatch.

Recomputation buys memory with work and nothing else: it adds computation to the compute
stream, collectives to the link (``layer`` runs a block's exchanges again), and reads of
recomputed values where the step without it reads kept ones, which are ready no later.
So a step that recomputes more is no faster than the same step recomputing less, in the
best order of each (a ZeRO-3 block gathers its parameters again in the backward pass
under every recomputation: :mod:`jaxmoe.layers.recompute`). Two exceptions, both small:
the schedules' orders are heuristics, and may come out slightly shorter with more work;
and a recomputed elementwise value is computed inside the backward kernels that read it
(as XLA fuses it), where a kept one is written by a forward kernel and read back, so on
a tiny model whose step is mostly per-op overheads ``matmuls`` comes out up to 6%
shorter than ``none`` (fewer kernels; ``tests/plan/test_planner.py``). At the seeds'
sizes the recomputed work outweighs it (Mixtral 8x22B at its recipe's batch, attention
16x4, MoE 1x8x8, pipeline 2, ZeRO-1, 16 microbatches: 3638 ms of compute with
``matmuls``, 3592 ms with ``none``). The planner walks each stage and microbatch count's
sets least recomputation first (:func:`recompute_chains`) and tries more only where less
does not fit.
The planner bounds a layout's option sets from one trace (:mod:`jaxmoe.plan.bounds`), of
the set that recomputes most, in one microbatch, at ZeRO-1: a fully sharded block
(ZeRO-3) keeps every value it makes for the backward pass (JAX's policy for its gathers),
where the plain step and ZeRO-1 keep what differentiation needs, so a ZeRO-3 trace would
not bound what the others keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmoe.config import Config
from jaxmoe.config.choices import RECOMPUTE
from jaxmoe.config.train import ZERO_STAGES

# The recomputations the planner searches and bounds (module docstring).
PLANNED_RECOMPUTE = ("none", "attention", "matmuls", "layer")


@dataclass(frozen=True)
class Options:
    zero: int = 0
    recompute: str = "none"
    microbatches: int = 1

    def label(self) -> str:
        return f"ZeRO-{self.zero}, recompute {self.recompute}, microbatches {self.microbatches}"


def options_of(config: Config) -> Options:
    """The options ``config`` runs with."""
    return Options(config.train.zero, config.model.recompute, config.train.microbatches)


def option_sets(config: Config, microbatches: bool = True) -> list[Options]:
    """Every set of options for ``config``'s model, batch and layout: each ZeRO stage
    (0 and 1 with a pipeline: Config refuses ZeRO-3 there) and recomputation, and (with
    ``microbatches``) every number of microbatches that divides the rows of an attention
    shard. Config checks each set against the layout. Recomputing the core attention is an
    option of the dense core alone: the flash cores keep no weights to recompute."""
    rows = config.train.batch_size // config.parallel.batch_shards
    counts = [m for m in range(1, rows + 1) if rows % m == 0] if microbatches else [1]
    stages = ZERO_STAGES if config.parallel.pipeline == 1 else (0, 1)
    recomputes = [
        r for r in PLANNED_RECOMPUTE if r != "attention" or config.model.attention == "dense"
    ]
    return [
        Options(zero, recompute, count)
        for zero in stages
        for recompute in recomputes
        for count in counts
    ]


def recompute_chains(sets: list[Options]) -> list[list[Options]]:
    """``sets`` by ZeRO stage and number of microbatches, each group least recomputation
    first (module docstring): where one of a group fits, those after it are never faster."""
    chains: dict[tuple[int, int], list[Options]] = {}
    for o in sorted(sets, key=lambda o: RECOMPUTE.index(o.recompute)):
        chains.setdefault((o.zero, o.microbatches), []).append(o)
    return list(chains.values())


def least_memory(sets: list[Options]) -> Options:
    """The set of least memory among ``sets``: the highest ZeRO stage and the most
    recomputation, in the fewest microbatches (see the module docstring)."""
    return max(sets, key=lambda o: (o.zero, RECOMPUTE.index(o.recompute), -o.microbatches))


def bounding(sets: list[Options]) -> Options:
    """The set the planner traces to bound the others of a layout (module docstring):
    the most recomputation, one microbatch, and ZeRO-1, or the stage nearest it."""
    return min(
        sets,
        key=lambda o: (-RECOMPUTE.index(o.recompute), o.microbatches, abs(o.zero - 1), o.zero),
    )
