"""The pipeline's tick table: which stage runs which microbatch through which chunk, when.

Arithmetic only (no JAX): the configuration checks it and the planner costs it before
anything is traced.

**Chunks.** ``parallel.pipeline`` P stages, ``parallel.virtual_stages`` V chunks per
stage: the layers are cut into C = P x V chunks of ``num_layers / C`` consecutive layers,
and chunk ``c = v P + s`` lives on stage ``s`` (Megatron-Core's interleaved
assignment; V = 1 is the plain one, a stage's layers consecutive).

**Lockstep.** The step is one SPMD program: every device runs the same code, so the
schedule is a sequence of *ticks* that all stages take together. A tick has a forward
slot and then a backward slot; in each, every stage runs the same chunk code on its own
microbatch and chunk (or on zeros, masked, where the table says it is idle). A chunk's
output reaches the next chunk's stage by one ``ppermute`` between ticks, so in the table
below one hop costs one tick.

Microbatch ``m`` enters at tick ``inj(m) = (m // P) P V + m % P`` (microbatches in
groups of P, each group running through all V chunks of a stage before the next group
starts: Megatron's interleaving; ``inj(m) = m`` when V = 1). Then

- forward of chunk ``c`` at tick ``f(m, c) = inj(m) + c``;
- backward of chunk ``c`` at tick ``b(m, c) = inj(m) + 2 (C - 1) - c``: the last chunk's
  backward runs in the same tick as its forward (its slot comes after the forward slot,
  where the loss is taken), and each hop back costs a tick.

No stage gets two forwards or two backwards in one tick (``inj(m) + v P`` and
``inj(m) - v P`` are distinct over ``(m, v)``). In steady state each stage runs one
forward and one backward per tick: the lockstep form of 1F1B (V = 1) and of the
interleaved 1F1B (V > 1).

**Cost.** A slot that no stage uses in a tick is not emitted (the table knows it
statically), so the warm-up ticks are forward-only and the cool-down ticks
backward-only, and the step takes ``busy_forward_ticks`` chunk forwards and
``busy_backward_ticks`` chunk backwards, both ``inj(M - 1) + C``. Against the
``M V`` of each that an unpipelined stage would run, the bubble is ``P - 1`` chunk
ticks when P divides M (``(P - 1) / V`` of a stage's work per microbatch: the
1F1B and interleaved bubbles of Megatron-Core), more when it does not.

**Memory.** The backward of ``(m, c)`` reads what the forward of ``(m, c)`` saved,
``2 (C - 1 - c)`` ticks earlier. In one SPMD program every device keeps what every
stage needs: the residuals of the last ``2 C - 1`` forward slots at most, that is
``2 P - 1 / V`` stage-microbatches of activations per device (Megatron's 1F1B keeps
``P - s`` on stage s: a lockstep hop takes a whole tick, where a stage of 1F1B hands its
output on after one forward).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import scheduling.names

# The name scope of tick i's slots in the step (jaxmoe.pipeline.pipelined); the memory walk
# follows the ticks by it (jaxmoe.plan.memory), and the pair schedules pair its slots.
TICK_SCOPE = scheduling.names.TICK_SCOPE


@dataclass(frozen=True)
class Slot:
    """One stage's work in one slot of a tick: microbatch ``microbatch`` through its
    virtual chunk ``virtual`` (the global chunk ``virtual * stages + stage``)."""

    microbatch: int
    virtual: int


@dataclass(frozen=True)
class Tick:
    """What each stage does in one tick (index: stage; None: idle)."""

    index: int
    forward: tuple[Slot | None, ...]
    backward: tuple[Slot | None, ...]

    @property
    def has_forward(self) -> bool:
        return any(slot is not None for slot in self.forward)

    @property
    def has_backward(self) -> bool:
        return any(slot is not None for slot in self.backward)


@dataclass(frozen=True)
class TickTable:
    """The tick table of ``stages`` x ``virtual`` chunks over ``microbatches``."""

    stages: int
    virtual: int
    microbatches: int

    def __post_init__(self) -> None:
        for name in ("stages", "virtual", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def chunk(self, stage: int, virtual: int) -> int:
        return virtual * self.stages + stage

    def injection(self, microbatch: int) -> int:
        """The tick at which ``microbatch`` enters the first chunk."""
        group, rank = divmod(microbatch, self.stages)
        return group * self.stages * self.virtual + rank

    def forward_tick(self, microbatch: int, chunk: int) -> int:
        return self.injection(microbatch) + chunk

    def backward_tick(self, microbatch: int, chunk: int) -> int:
        return self.injection(microbatch) + 2 * (self.chunks - 1) - chunk

    def distance(self, chunk: int) -> int:
        """Ticks between a chunk's forward and its backward (the same for every
        microbatch)."""
        return 2 * (self.chunks - 1 - chunk)

    @cached_property
    def ticks(self) -> tuple[Tick, ...]:
        count = self.backward_tick(self.microbatches - 1, 0) + 1
        forward = [[None] * self.stages for _ in range(count)]
        backward = [[None] * self.stages for _ in range(count)]
        for m in range(self.microbatches):
            for v in range(self.virtual):
                for s in range(self.stages):
                    c = self.chunk(s, v)
                    for table, tick in (
                        (forward, self.forward_tick(m, c)),
                        (backward, self.backward_tick(m, c)),
                    ):
                        if table[tick][s] is not None:
                            raise AssertionError(f"stage {s} holds two slots at tick {tick}")
                        table[tick][s] = Slot(m, v)
        return tuple(Tick(t, tuple(forward[t]), tuple(backward[t])) for t in range(count))

    @property
    def busy_forward_ticks(self) -> int:
        """Ticks with a forward slot (on at least one stage): what the step runs."""
        return sum(tick.has_forward for tick in self.ticks)

    @property
    def busy_backward_ticks(self) -> int:
        return sum(tick.has_backward for tick in self.ticks)

    @property
    def bubble_chunk_ticks(self) -> int:
        """Chunk forwards (and as many backwards) a stage waits for, beyond its own
        ``microbatches x virtual``: ``stages - 1`` when ``stages`` divides
        ``microbatches``."""
        return self.busy_forward_ticks - self.microbatches * self.virtual

    @property
    def bubble_fraction(self) -> float:
        """The share of the pipelined part of the step a stage is idle: the bubble over
        the busy ticks (forward and backward alike)."""
        return self.bubble_chunk_ticks / self.busy_forward_ticks

    @cached_property
    def residuals_held(self) -> int:
        """The most forward slots whose residuals a device holds at once (``2 C - 1`` at
        most), the ticks run in order: before each backward slot, every forward slot
        that it or a later backward slot reads (the activation memory of the pipeline, in
        chunk-microbatches)."""
        last_read: dict[int, int] = {}  # forward tick -> the last backward tick reading it
        for tick in self.ticks:
            for stage, slot in enumerate(tick.backward):
                if slot is not None:
                    forward = tick.index - self.distance(self.chunk(stage, slot.virtual))
                    last_read[forward] = tick.index
        return max(
            sum(forward <= tick.index <= last for forward, last in last_read.items())
            for tick in self.ticks
            if tick.has_backward
        )


def chunk_layers(num_layers: int, stages: int, virtual: int) -> int:
    """Layers per chunk; ValueError when the chunks cannot be equal."""
    chunks = stages * virtual
    if num_layers % chunks:
        raise ValueError(f"{num_layers} layers do not split into {chunks} equal chunks")
    return num_layers // chunks


def chunk_layer(layer_in_chunk: int, chunk: int, per_chunk: int) -> int:
    """The model's layer index of a chunk's ``layer_in_chunk``-th layer."""
    return chunk * per_chunk + layer_in_chunk


@functools.cache
def tick_table(stages: int, virtual: int, microbatches: int) -> TickTable:
    """The :class:`TickTable` of this shape, its ticks built once: the planner bounds
    thousands of pipelined option sets on a few shapes."""
    return TickTable(stages, virtual, microbatches)
