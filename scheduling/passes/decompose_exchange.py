"""Rewrite exchange regions into pieces that compute as their tokens arrive (COMET).

``rounds`` (see ``exchange_regions``): the dispatch's operand is rotated so
that block ``r`` is the one for device ``(i + r) % G``; round 0 keeps the local
block, every other round is one ``ppermute``. Split values the pieces read
(residuals of the forward pass, in a backward region) are rotated into round
order once and cut with static slices. Piece ``r`` runs the region's ops on
its round's tokens and is sent straight back with the inverse ``ppermute``
(round 0 stays); the combine's result is reassembled from the returned pieces
and rotated back. ``chunks``: the dispatch, the ops and the combine run once
per chunk, each chunk exchanged by its own smaller ``all_to_all``.

The pieces are emitted one after the other, each right after its transfer, so
the ordering pass (which starts a collective as soon as its operand exists and
waits only where its result is needed) overlaps piece ``r``'s computation with
the transfers of the others. Piece results read outside the region are
reassembled (and in ``rounds`` rotated back to source order) after the last
piece; deferred ops then run on them. A backward region decomposed like its
layer's forward region takes the forward's residual pieces as they are, so a
residual read only there is never reassembled. Each op computes what it computed in the
original program: only data movement is added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from scheduling.passes import chunk_ops, exchange_ops
from scheduling.passes.exchange_regions import DecomposedRegion
from scheduling.passes.partition_forward import consumers_of
from scheduling.program.capture import Atom, Op, Program, Value
from scheduling.program.partition_rules import Split


def signature(region: DecomposedRegion) -> tuple:
    """Regions of equal signature cut their shared values into the same pieces."""
    d = region.decomposition
    return (d.kind, d.pieces, d.piece_axis, region.piece_size, region.exchange.group)


def _cuts(program: Program, region: DecomposedRegion, position: int, value: Value) -> bool:
    """Whether chunked op ``position`` of ``region`` reads ``value`` piece by piece."""
    if position not in region.chunkings or position not in region.chunked:
        return False
    op = program.ops[position]
    how = region.chunkings[position]
    return any(a is value and cut is not None for a, cut in zip(op.inputs, how.inputs, strict=True))


def values_needed_whole(program: Program, regions: Sequence[DecomposedRegion]) -> set[Value]:
    """The escaping piece results that some reader needs whole. A later region of the same
    signature that cuts one (a backward region reading a forward residual) takes its
    pieces as they are: neither reassembled nor rotated nor cut again."""
    consumers = consumers_of(program)
    needed: set[Value] = set()
    for region in regions:
        for value in region.escaping:
            for reader in consumers.get(value, ()):
                if reader in region.chunked:
                    continue
                shared = any(
                    other.begin > region.begin
                    and signature(other) == signature(region)
                    and _cuts(program, other, reader, value)
                    for other in regions
                )
                if not shared:
                    needed.add(value)
    return needed


def materialize(
    program: Program,
    region: DecomposedRegion,
    remap: dict[Value, Atom],
    shared: dict[tuple, list[Value]] | None = None,
    needed_whole: set[Value] | None = None,
) -> list[Op]:
    """The ops that replace the region; ``remap`` gains each escaping value's reassembly.

    ``shared`` holds the pieces of earlier regions' escaping values by signature; this
    region reads its seeds from it where it can, and adds its own. Escaping values not in
    ``needed_whole`` (None: all) are not reassembled.
    """
    shared = {} if shared is None else shared
    exchange = region.exchange
    dispatch, combine = program.ops[exchange.dispatch], program.ops[exchange.combine]
    phase, stack = dispatch.phase, dispatch.name_stack
    rounds = region.decomposition.kind == "rounds"
    n, size = region.decomposition.pieces, region.piece_size
    axis_name = dispatch.eqn.params["axis_name"]
    axis_env = tuple(program.mesh.shape.items())
    ops_out: list[Op] = []
    pieces: dict[tuple[Value, int], Value] = {}
    in_round_order: dict[Value, Value] = {}
    cut_seeds: dict[tuple[Value, int], Value] = {}
    uniform_slices: dict[tuple[Atom, int], Value] = {}

    def read(atom: Atom) -> Atom:
        return remap.get(atom, atom) if isinstance(atom, Value) else atom

    def emit(made: tuple[list[Op], Value]) -> Value:
        new_ops, result = made
        ops_out.extend(new_ops)
        return result

    def rotate(atom: Atom, split: Split, toward: str) -> Value:
        return emit(exchange_ops.rotate(atom, split, n, toward, axis_name, axis_env, stack, phase))

    def seed_piece(atom: Value, piece: int) -> Value:
        if (signature(region), atom) in shared:
            return shared[signature(region), atom][piece]
        if (atom, piece) not in cut_seeds:
            split = region.layouts[atom]
            whole: Atom = read(atom)
            if rounds:
                if atom not in in_round_order:
                    in_round_order[atom] = rotate(whole, split, "source")
                whole = in_round_order[atom]
            cut = chunk_ops.take_chunk(whole, split, size, n, piece, stack, phase)
            cut_seeds[atom, piece] = emit(cut)
        return cut_seeds[atom, piece]

    def operand(atom: Atom, cut: int | None, piece: int) -> Atom:
        if cut is None:
            return read(atom)
        if (atom, piece) in pieces:
            return pieces[atom, piece]
        if isinstance(atom, Value) and atom in region.layouts:
            return seed_piece(atom, piece)
        if (atom, cut) not in uniform_slices:  # uniform along the cut: any 1/n slice
            uniform_slices[atom, cut] = emit(chunk_ops.take_slice(read(atom), cut, n, stack, phase))
        return uniform_slices[atom, cut]

    for position in region.replicated:
        op = program.ops[position]
        ops_out.append(dataclasses.replace(op, inputs=tuple(read(a) for a in op.inputs)))

    source_split = Split(exchange.axis)
    returned: list[Value] = []
    if rounds:
        (sent,) = dispatch.inputs
        by_destination = rotate(read(sent), source_split, "destination")

    def run_piece(position: int, piece: int) -> None:
        op = program.ops[position]
        how = region.chunkings[position]
        inputs = [
            operand(atom, cut, piece) for atom, cut in zip(op.inputs, how.inputs, strict=True)
        ]
        copy = chunk_ops.chunk_copy(op, how, n, inputs)
        ops_out.append(copy)
        pieces.update({(v, piece): r for v, r in zip(op.outputs, copy.outputs, strict=True)})

    # Every piece's transfer is issued first, so each goes out as soon as the link allows.
    for piece in range(n):
        if rounds:
            block = emit(
                chunk_ops.take_chunk(by_destination, source_split, n, n, piece, stack, phase)
            )
            if piece:
                block = emit(
                    exchange_ops.send_round(block, piece, n, axis_name, axis_env, stack, phase)
                )
            pieces[dispatch.outputs[0], piece] = block
        else:
            run_piece(exchange.dispatch, piece)
    computed = [p for p in region.chunked if p != exchange.dispatch]
    for piece in range(n):
        for position in computed:
            run_piece(position, piece)
        if rounds:
            block = pieces[combine.inputs[0], piece]
            if piece:
                block = emit(
                    exchange_ops.send_round(block, -piece, n, axis_name, axis_env, stack, phase)
                )
            returned.append(block)

    if rounds:
        joined = emit(chunk_ops.join_chunks(returned, source_split, stack, phase))
        remap[combine.outputs[0]] = rotate(joined, source_split, "back")
    for value in region.escaping:
        split = region.layouts[value]
        parts = [pieces[value, piece] for piece in range(n)]
        shared[signature(region), value] = parts
        if needed_whole is not None and value not in needed_whole:
            continue
        joined = emit(chunk_ops.join_chunks(parts, split, stack, phase))
        remap[value] = rotate(joined, split, "source") if rounds else joined

    for position in region.deferred:
        op = program.ops[position]
        ops_out.append(dataclasses.replace(op, inputs=tuple(read(a) for a in op.inputs)))
    return ops_out


def decompose_program(program: Program, regions: list[DecomposedRegion]) -> Program:
    """``program`` with each (non-overlapping) region replaced by its pieces."""
    remap: dict[Value, Atom] = {}
    shared: dict[tuple, list[Value]] = {}
    needed = values_needed_whole(program, regions)
    starts = {region.begin: region for region in regions}
    new_ops: list[Op] = []
    position = 0
    while position < len(program.ops):
        region = starts.get(position)
        if region is not None:
            new_ops.extend(materialize(program, region, remap, shared, needed))
            position = region.end
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
