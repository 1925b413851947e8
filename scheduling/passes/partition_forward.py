"""Partition a range of the forward pass into ``n`` pipelined chunks (Lancet's forward overlap).

A range is an interval of the program's forward ops. Within it every op is one of:

- *chunked*: it has a partition rule and reads a split value; it runs ``n``
  times, once per chunk of the batch;
- *replicated*: it reads nothing that depends on the batch inside the range
  (weights, their casts, masks); it runs once, before the chunks;
- *deferred*: it reads chunked results but has no rule (a reduction over the
  batch, such as a loss term or a routing statistic); it runs once, after the
  chunks, on the reassembled values. A chunked op that would need a deferred
  result ends the range there.

The chunks are independent but for explicit carries (prefix operations), so
chunk ``c``'s all-to-all can run while chunk ``c + 1`` computes. The copies
are emitted as a software pipeline: the range is cut into stages at its
all-to-alls, and slot ``t`` runs stage ``s`` of chunk ``t - s`` for every
stage, lowest first (an all-gather or reduce-scatter of a tensor-parallel block
starts a stage too, so it overlaps the neighbouring chunk's compute). Split
values made before the range are cut into chunks where a chunk first reads
them; every chunked result that is read after the range (the next layers, the
deferred ops, residuals for the backward pass) is reassembled as soon as its
last chunk exists. What the range computes is what the original computes, value
for value.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from scheduling.passes import chunk_ops
from scheduling.program.batch_layout import BatchLayouts
from scheduling.program.capture import Atom, Op, Phase, Program, Value

# Chunked collectives that end a pipeline stage: the next stage waits for them.
PIPELINED_COLLECTIVES = frozenset({"all_to_all", "all_gather", "reduce_scatter"})


@dataclass
class RangeCut:
    """What a range does, op by op, for ``n`` chunks."""

    begin: int  # first op position
    end: int  # one past the last op position
    n: int
    chunked: list[int]
    stages: dict[int, int]  # chunked op position -> pipeline stage
    replicated: list[int]
    deferred: list[int]
    # Stages: a collective in stage s is waited for by stage s + 1 (which may be empty).
    num_stages: int = 1
    seeds: list[Value] = field(default_factory=list)  # split values from before the range
    escaping: list[Value] = field(default_factory=list)  # chunked results read after it


def consumers_of(program: Program) -> dict[Value, list[int]]:
    """Positions of the ops reading each value; program results count as ``len(ops)``."""
    consumers: dict[Value, list[int]] = defaultdict(list)
    for position, op in enumerate(program.ops):
        for atom in op.inputs:
            if isinstance(atom, Value):
                consumers[atom].append(position)
    for atom in program.outputs:
        if isinstance(atom, Value):
            consumers[atom].append(len(program.ops))
    return consumers


def cut_range(
    program: Program,
    layouts: BatchLayouts,
    consumers: dict[Value, list[int]],
    begin: int,
    end: int,
    n: int,
) -> RangeCut | None:
    """How ops ``[begin, end)`` run in ``n`` chunks, ended early where it must be.

    None when ``n`` does not divide the batch or no all-to-all would be chunked.
    """
    return next(cut_ranges(program, layouts, consumers, begin, (end,), n))


def cut_ranges(
    program: Program,
    layouts: BatchLayouts,
    consumers: dict[Value, list[int]],
    begin: int,
    ends: Sequence[int],
    n: int,
) -> Iterator[RangeCut | None]:
    """:func:`cut_range` of ``[begin, end)`` for each of the increasing ``ends``, in one
    pass over the ops: a range's cut is the cut of the range it extends, and more."""
    if n < 2 or layouts.batch_size % n:
        yield from (None for _ in ends)
        return
    chunked: list[int] = []
    stages: dict[int, int] = {}
    replicated: list[int] = []
    deferred: list[int] = []
    value_stage: dict[Value, int] = {}  # chunked result -> stage of its readers
    unread: dict[Value, int] = {}  # chunked result -> its reads by ops not chunked (yet)
    last_stage = 0  # the latest stage of a chunked result
    deferred_values: set[Value] = set()
    seeds: dict[Value, None] = {}
    exchanges = 0  # chunked all-to-alls
    stop = None  # where the range had to end
    position = begin
    for end in ends:
        while stop is None and position < end:
            op = program.ops[position]
            if op.phase is not Phase.FORWARD:
                stop = position
                break
            reads = [a for a in op.inputs if isinstance(a, Value)]
            reads_deferred = any(a in deferred_values for a in reads)
            how = layouts.chunkings.get(position)
            if how is not None:
                if reads_deferred:
                    stop = position  # it would wait for every chunk: the range ends here
                    break
                stage = max((value_stage[a] for a in reads if a in value_stage), default=0)
                chunked.append(position)
                stages[position] = stage
                after = stage + 1 if op.primitive in PIPELINED_COLLECTIVES else stage
                value_stage.update(dict.fromkeys(op.outputs, after))
                if op.outputs:
                    last_stage = max(last_stage, after)
                for atom in reads:  # one read per operand, as ``consumers`` counts them
                    if atom in unread:
                        unread[atom] -= 1
                unread.update((value, len(consumers.get(value, ()))) for value in op.outputs)
                exchanges += op.primitive == "all_to_all"
                # A split value from before the range (made before its reader, so not
                # made in the range later).
                for atom, cut in zip(op.inputs, how.inputs, strict=True):
                    if (
                        cut is not None
                        and atom not in value_stage
                        and layouts.layout(atom) is not None
                    ):
                        seeds[atom] = None
            elif reads_deferred or any(a in value_stage for a in reads):
                deferred.append(position)
                deferred_values.update(op.outputs)
            else:
                replicated.append(position)
            position += 1
        if not exchanges:
            yield None
            continue
        yield RangeCut(
            begin,
            min(end, position) if stop is None else stop,
            n,
            list(chunked),
            dict(stages),
            list(replicated),
            list(deferred),
            last_stage + 1,
            list(seeds),
            [value for value in value_stage if unread[value]],
        )


def materialize(
    program: Program, layouts: BatchLayouts, range_cut: RangeCut, remap: dict[Value, Atom]
) -> list[Op]:
    """The ops that replace the range; ``remap`` gains each escaping value's reassembly."""
    ops_out: list[Op] = []
    n = range_cut.n
    escaping = set(range_cut.escaping)
    chunks: dict[tuple[Value, int], Value] = {}
    seed_chunks: dict[tuple[Value, int], Value] = {}
    uniform_slices: dict[tuple[Atom, int], Value] = {}

    def read(atom: Atom) -> Atom:
        return remap.get(atom, atom) if isinstance(atom, Value) else atom

    def operand(atom: Atom, cut: int | None, chunk: int, name_stack: str) -> Atom:
        if cut is None:
            return read(atom)
        if (atom, chunk) in chunks:
            return chunks[atom, chunk]
        split = layouts.layout(atom)
        if split is not None:
            if (atom, chunk) not in seed_chunks:
                new_ops, piece = chunk_ops.take_chunk(
                    read(atom), split, layouts.batch_size, n, chunk, name_stack
                )
                ops_out.extend(new_ops)
                seed_chunks[atom, chunk] = piece
            return seed_chunks[atom, chunk]
        # Uniform along the cut axis: every chunk reads the same slice.
        if (atom, cut) not in uniform_slices:
            new_ops, piece = chunk_ops.take_slice(read(atom), cut, n, name_stack)
            ops_out.extend(new_ops)
            uniform_slices[atom, cut] = piece
        return uniform_slices[atom, cut]

    for position in range_cut.replicated:
        op = program.ops[position]
        ops_out.append(dataclasses.replace(op, inputs=tuple(read(a) for a in op.inputs)))

    by_stage: dict[int, list[int]] = defaultdict(list)
    for position in range_cut.chunked:
        by_stage[range_cut.stages[position]].append(position)
    for slot in range(n + range_cut.num_stages - 1):
        for stage in range(range_cut.num_stages):
            chunk = slot - stage
            if not 0 <= chunk < n:
                continue
            for position in by_stage[stage]:
                op = program.ops[position]
                how = layouts.chunkings[position]
                inputs = [
                    operand(atom, cut, chunk, op.name_stack)
                    for atom, cut in zip(op.inputs, how.inputs, strict=True)
                ]
                copy = chunk_ops.chunk_copy(op, how, n, inputs)
                ops_out.append(copy)
                results = list(copy.outputs)
                if how.carry is not None and chunk > 0:
                    (original,) = op.outputs
                    carry_ops, results[0] = chunk_ops.apply_carry(
                        copy.outputs[0],
                        chunks[original, chunk - 1],
                        how.outputs[0].axis,
                        how.carry,
                        op.name_stack,
                    )
                    ops_out.extend(carry_ops)
                for value, result in zip(op.outputs, results, strict=True):
                    chunks[value, chunk] = result
                    if chunk == n - 1 and value in escaping:
                        parts = [chunks[value, c] for c in range(n)]
                        join_ops, whole = chunk_ops.join_chunks(
                            parts, layouts.layouts[value], op.name_stack
                        )
                        ops_out.extend(join_ops)
                        remap[value] = whole

    for position in range_cut.deferred:
        op = program.ops[position]
        ops_out.append(dataclasses.replace(op, inputs=tuple(read(a) for a in op.inputs)))
    return ops_out


def partition_program(program: Program, layouts: BatchLayouts, cuts: list[RangeCut]) -> Program:
    """``program`` with each (non-overlapping) range replaced by its chunked pipeline."""
    remap: dict[Value, Atom] = {}
    starts = {range_cut.begin: range_cut for range_cut in cuts}
    new_ops: list[Op] = []
    position = 0
    while position < len(program.ops):
        range_cut = starts.get(position)
        if range_cut is not None:
            new_ops.extend(materialize(program, layouts, range_cut, remap))
            position = range_cut.end
            continue
        op = program.ops[position]
        new_ops.append(
            dataclasses.replace(
                op, inputs=tuple(remap.get(a, a) if isinstance(a, Value) else a for a in op.inputs)
            )
        )
        position += 1
    new_ops = [dataclasses.replace(op, index=i) for i, op in enumerate(new_ops)]
    outputs = [remap.get(a, a) if isinstance(a, Value) else a for a in program.outputs]
    return dataclasses.replace(program, ops=new_ops, outputs=outputs)
