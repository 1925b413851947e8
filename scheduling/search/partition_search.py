"""Which forward ranges to partition, and into how many chunks: Lancet's dynamic programme.

The forward ops are cut into *op groups*: runs of ops of the same layer, with
a group boundary after every all-to-all. A candidate range is a run of
consecutive groups that holds the all-to-alls of one MoE layer only, so it is
never longer than the distance between the all-to-alls before and after it.
For every candidate and every chunk count ``n`` in 2..8 that divides the
batch, :func:`pipeline_seconds` replays the chunked range on a compute stream
and a communication stream with the cost model's times. A dynamic programme
over group boundaries then picks the set of non-overlapping ranges (and their
``n``) with the least total estimated time; a range is kept only where its
estimate beats the same groups unpartitioned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduling.passes import chunk_ops
from scheduling.passes.partition_forward import (
    PIPELINED_COLLECTIVES,
    RangeCut,
    consumers_of,
    cut_range,
    cut_ranges,
)
from scheduling.program.batch_layout import BatchLayouts
from scheduling.program.capture import Op, Phase, Program, Value

CHUNK_COUNTS = tuple(range(2, 9))
# Seconds of a chunk copy (the second op) of an op of the program (the first): priced as
# the program's op is fused (scheduling.costs.cost_model.CostModel.chunk_seconds).
ChunkSeconds = Callable[[Op, Op], float]
# With ``always``, each kept range lowers the objective by this much, so the programme
# partitions wherever it legally can (and picks the best estimate among those choices).
_ALWAYS_BONUS = 1e6


@dataclass(frozen=True)
class PartitionChoice:
    cut: RangeCut
    estimated_seconds: float  # the range partitioned, on two streams
    unpartitioned_seconds: float  # the same ops in program order, collectives blocking

    @property
    def estimated_gain_seconds(self) -> float:
        return self.unpartitioned_seconds - self.estimated_seconds


def pipeline_seconds(
    stage_seconds: Sequence[float],
    collective_seconds: Sequence[float],
    n: int,
    before: float = 0.0,
    after: float = 0.0,
) -> float:
    """Time of ``n`` chunks through ``len(stage_seconds)`` stages in pipeline order.

    ``stage_seconds[s]`` is one chunk's compute in stage ``s``; ``collective_seconds[s]``
    one chunk's all-to-all after stage ``s`` (which stage ``s + 1`` waits for). The
    compute stream runs slot ``t`` = stage ``s`` of chunk ``t - s``, lowest stage first;
    the communication stream runs the all-to-alls one at a time in launch order.
    """
    stages = len(stage_seconds)
    clock = before
    link_free = 0.0
    arrived: dict[tuple[int, int], float] = {}
    for slot in range(n + stages - 1):
        for stage in range(stages):
            chunk = slot - stage
            if not 0 <= chunk < n:
                continue
            if stage > 0:
                clock = max(clock, arrived.get((stage - 1, chunk), 0.0))
            clock += stage_seconds[stage]
            if stage < len(collective_seconds):
                began = max(clock, link_free)
                link_free = began + collective_seconds[stage]
                arrived[stage, chunk] = link_free
    return clock + after


class _RangeCosts:
    """Estimated seconds of ranges, with per-op chunk costs cached across candidates."""

    def __init__(
        self,
        program: Program,
        layouts: BatchLayouts,
        seconds: Callable[[Op], float],
        chunk_seconds: ChunkSeconds | None = None,
    ):
        self.program = program
        self.layouts = layouts
        self.seconds = seconds
        self.chunk_seconds = chunk_seconds or (lambda original, copy: seconds(copy))
        self._whole: dict[int, float] = {}
        self._chunk: dict[tuple[int, int], float] = {}
        self._cut: dict[tuple[Value, int], float] = {}
        self._join: dict[tuple[Value, int], float] = {}

    def whole(self, position: int) -> float:
        if position not in self._whole:
            self._whole[position] = self.seconds(self.program.ops[position])
        return self._whole[position]

    def chunk(self, position: int, n: int) -> float:
        key = (position, n)
        if key not in self._chunk:
            op = self.program.ops[position]
            how = self.layouts.chunkings[position]
            inputs = [
                atom if cut is None else Value(chunk_ops.chunk_aval(atom.aval, cut, n))
                for atom, cut in zip(op.inputs, how.inputs, strict=True)
            ]
            copy = chunk_ops.chunk_copy(op, how, n, inputs)
            self._chunk[key] = self.chunk_seconds(op, copy)
        return self._chunk[key]

    def cut(self, value: Value, n: int) -> float:
        """Cutting one chunk out of a split value."""
        key = (value, n)
        if key not in self._cut:
            split = self.layouts.layouts[value]
            ops, _ = chunk_ops.take_chunk(value, split, self.layouts.batch_size, n, 0, "")
            self._cut[key] = sum(self.seconds(op) for op in ops)
        return self._cut[key]

    def join(self, value: Value, n: int) -> float:
        """Reassembling a split value from its ``n`` chunks."""
        key = (value, n)
        if key not in self._join:
            split = self.layouts.layouts[value]
            part = Value(chunk_ops.chunk_aval(value.aval, split.axis, n))
            ops, _ = chunk_ops.join_chunks([part] * n, split, "")
            self._join[key] = sum(self.seconds(op) for op in ops)
        return self._join[key]

    def unpartitioned(self, begin: int, end: int) -> float:
        return sum(self.whole(p) for p in range(begin, end))

    def partitioned(self, range_cut: RangeCut) -> float:
        """The range's estimate on two streams (:func:`pipeline_seconds`)."""
        return _Extending(self, range_cut.n).partitioned(range_cut)


class _Extending:
    """The estimates of the cuts of one range as it extends (for one ``n``), each cut's
    lists those of the cut before it and more: the sums of the ops seen carried over, each
    new op added in order. (One cut alone: :meth:`_RangeCosts.partitioned`.)"""

    def __init__(self, costs: _RangeCosts, n: int):
        self.costs, self.n = costs, n
        self.compute: list[float] = []  # by stage
        self.collectives: list[float] = []
        self.seeded = self.before = self.after = 0.0
        self.counted = [0, 0, 0, 0]  # chunked, seeds, replicated and deferred summed

    def partitioned(self, cut: RangeCut) -> float:
        costs, n, counted = self.costs, self.n, self.counted
        stages = cut.num_stages
        self.compute += [0.0] * (stages - len(self.compute))
        self.collectives += [0.0] * (stages - 1 - len(self.collectives))
        for position in cut.chunked[counted[0] :]:
            stage = cut.stages[position]
            if costs.program.ops[position].primitive in PIPELINED_COLLECTIVES:
                self.collectives[stage] += costs.chunk(position, n)
            else:
                self.compute[stage] += costs.chunk(position, n)
        for seed in cut.seeds[counted[1] :]:
            self.seeded += costs.cut(seed, n)
        for position in cut.replicated[counted[2] :]:
            self.before += costs.whole(position)
        for position in cut.deferred[counted[3] :]:
            self.after += costs.whole(position)
        self.counted = [len(cut.chunked), len(cut.seeds), len(cut.replicated), len(cut.deferred)]
        compute = list(self.compute)
        compute[0] += self.seeded
        after = self.after + sum(costs.join(value, n) for value in cut.escaping)
        return pipeline_seconds(compute, list(self.collectives), n, self.before, after)


def op_groups(program: Program) -> list[tuple[int, int]]:
    """``[begin, end)`` of each op group of the forward pass, in program order."""
    groups: list[tuple[int, int]] = []
    begin = 0
    for position, op in enumerate(program.ops):
        if op.phase is not Phase.FORWARD:
            break
        nxt = program.ops[position + 1] if position + 1 < len(program.ops) else None
        boundary = (
            op.primitive == "all_to_all"
            or nxt is None
            or nxt.phase is not Phase.FORWARD
            or nxt.layer != op.layer
        )
        if boundary:
            groups.append((begin, position + 1))
            begin = position + 1
    return groups


@dataclass(frozen=True)
class RangeCandidate:
    """A range that can be partitioned: groups ``first..last``, its cut for one ``n``."""

    first: int  # index of its first op group
    last: int  # index of its last op group
    choice: PartitionChoice


def candidates(
    program: Program,
    layouts: BatchLayouts,
    seconds: Callable[[Op], float],
    chunk_counts: Sequence[int] = CHUNK_COUNTS,
    chunk_seconds: ChunkSeconds | None = None,
) -> tuple[list[tuple[int, int]], list[RangeCandidate], Callable[[int, int], float]]:
    """The op groups; every range (of one MoE layer's all-to-alls) with every ``n``; and
    the estimate of ops ``[begin, end)`` unpartitioned."""
    groups = op_groups(program)
    consumers = consumers_of(program)
    costs = _RangeCosts(program, layouts, seconds, chunk_seconds)
    counts = [n for n in chunk_counts if n >= 2 and layouts.batch_size % n == 0]
    exchange_layers = [
        {program.ops[p].layer for p in range(b, e) if program.ops[p].primitive == "all_to_all"}
        for b, e in groups
    ]
    found: list[RangeCandidate] = []
    for first, (begin, _) in enumerate(groups):
        if not counts:
            break
        # The ranges from ``first`` that hold one MoE layer's all-to-alls: ``lasts``.
        layers: set[str] = set()
        lasts = []
        for last in range(first, len(groups)):
            layers |= exchange_layers[last]
            if len(layers) > 1:
                break  # would span the all-to-alls of two MoE layers
            if layers:
                lasts.append(last)
        # The cut does not depend on n but for n itself: cut once per range, each range
        # from ``first`` extending the one before it.
        ends = [groups[last][1] for last in lasts]
        cuts = cut_ranges(program, layouts, consumers, begin, ends, counts[0])
        extending = [_Extending(costs, n) for n in counts]
        unpartitioned, summed = 0.0, begin  # of ops [begin, summed)
        for last, range_end, cut in zip(lasts, ends, cuts, strict=True):
            if cut is None:
                continue
            if cut.end != range_end:
                break  # the range had to end before: so do the longer ones
            for position in range(summed, range_end):
                unpartitioned += costs.whole(position)
            summed = range_end
            for n, sums in zip(counts, extending, strict=True):
                sized = dataclasses.replace(cut, n=n)
                choice = PartitionChoice(sized, sums.partitioned(sized), unpartitioned)
                found.append(RangeCandidate(first, last, choice))
    return groups, found, costs.unpartitioned


def choose(
    groups: Sequence[tuple[int, int]],
    found: Sequence[RangeCandidate],
    unpartitioned: Callable[[int, int], float],
    always: bool = False,
) -> list[PartitionChoice]:
    """The dynamic programme: non-overlapping ranges of least total estimated time.

    A range is kept only where its estimate beats the same groups unpartitioned, or
    wherever it can be with ``always``.
    """
    by_first: dict[int, list[RangeCandidate]] = {}
    for candidate in found:
        by_first.setdefault(candidate.first, []).append(candidate)
    best = [0.0] + [float("inf")] * len(groups)
    back: list[tuple[int, PartitionChoice | None]] = [(0, None)] * (len(groups) + 1)
    for first, (begin, end) in enumerate(groups):
        stay = best[first] + unpartitioned(begin, end)
        if stay < best[first + 1]:
            best[first + 1], back[first + 1] = stay, (first, None)
        for candidate in by_first.get(first, ()):
            choice = candidate.choice
            if choice.estimated_seconds >= choice.unpartitioned_seconds and not always:
                continue
            objective = best[first] + choice.estimated_seconds
            objective -= _ALWAYS_BONUS if always else 0.0
            if objective < best[candidate.last + 1]:
                best[candidate.last + 1] = objective
                back[candidate.last + 1] = (first, choice)
    choices: list[PartitionChoice] = []
    position = len(groups)
    while position > 0:
        previous, choice = back[position]
        if choice is not None:
            choices.append(choice)
        position = previous
    return choices[::-1]


def search(
    program: Program,
    layouts: BatchLayouts,
    seconds: Callable[[Op], float],
    chunk_counts: Sequence[int] = CHUNK_COUNTS,
    always: bool = False,
    chunk_seconds: ChunkSeconds | None = None,
) -> list[PartitionChoice]:
    """The ranges to partition, in program order, with their estimates."""
    groups, found, unpartitioned = candidates(
        program, layouts, seconds, chunk_counts, chunk_seconds
    )
    return choose(groups, found, unpartitioned, always)


def expert_pipelines(
    program: Program,
    layouts: BatchLayouts,
    n: int,
    seconds: Callable[[Op], float],
    chunk_seconds: ChunkSeconds | None = None,
) -> list[PartitionChoice]:
    """The Tutel-style baseline: each MoE layer from its first forward all-to-all to its
    last, in ``n`` chunks (no search; a layer whose range cannot be chunked is left)."""
    consumers = consumers_of(program)
    costs = _RangeCosts(program, layouts, seconds, chunk_seconds)
    by_layer: dict[str, list[int]] = {}
    for position, op in enumerate(program.ops):
        if op.primitive == "all_to_all" and op.phase is Phase.FORWARD:
            by_layer.setdefault(op.layer, []).append(position)
    choices = []
    for positions in by_layer.values():
        begin, end = positions[0], positions[-1] + 1
        cut = cut_range(program, layouts, consumers, begin, end, n)
        if cut is not None and cut.end == end:
            choices.append(
                PartitionChoice(cut, costs.partitioned(cut), costs.unpartitioned(begin, end))
            )
    return choices
