"""Recognise the expert exchanges of a program and how each decomposes (COMET).

What is recognised. An *exchange* is a pair of ``all_to_all`` ops over the same
axes, with ``split_axis == concat_axis == k``, untiled, without
``axis_index_groups``, whose operands have the group size ``G`` along ``k``:
the *dispatch* ``A``, and the *combine* ``B``, the first ``all_to_all`` after
``A`` in program order that reads a value computed from ``A``'s result. Row
``j`` of ``A``'s result holds what device ``j`` sent (its tokens for this
device's experts); row ``j`` of ``B``'s operand goes back to device ``j``.
Between them lie the expert computation and anything else the program puts
there. This is an MoE layer's forward pass (dispatch, experts, combine) and,
in the backward pass, its transpose (the combine's cotangent exchanged first,
the experts' transposed GEMMs, the dispatch's cotangent exchanged back).

A region can be decomposed into *pieces* when every op between ``A`` and
``B`` that reads ``A``'s result (directly or not) and feeds ``B`` has a
partition rule (``partition_rules``) along the piece axis, so that each piece
of ``B``'s operand is computed from the same piece of ``A``'s result alone:

- ``rounds``: the pieces are the ``G`` sources (the split axis ``k``, with
  ``P = G``). Piece ``r`` is computed on the tokens of source ``(i - r) % G``;
  round 0 is this device's own tokens, which need no transfer.
- ``chunks``: the pieces are ``n`` chunks along another axis of ``A``'s operand
  (the slots), each exchanged by its own, smaller ``all_to_all``.

Ops between ``A`` and ``B`` that do not read ``A``'s result are *replicated*
(run once, before the pieces); ops that read it but have no rule (the weight
gradients, which sum over the tokens; reductions over them) are *deferred*:
they run once, after the pieces, on the reassembled values, so they compute
exactly what they computed before. A region whose ``B`` would need a deferred
value is not decomposed.

The layouts come from one propagation per MoE layer and piece axis over the
whole span from the layer's forward dispatch to its backward combine, so a
backward region can cut the forward residuals (e.g. the experts' hidden
activations) into the same pieces.

Ragged exchanges (a dropless layer that moves only its routed rows:
``ragged_all_to_all``, or its static form, an ``all_to_all`` under a
``ragged_rows`` scope) are recognised and refused (:data:`RAGGED_REFUSAL`): their
rows are placed by counts known only when the step runs, so no fixed piece of them
is one source's tokens or one chunk's. They run whole, as captured.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from scheduling.costs.cost_model import is_ragged_exchange
from scheduling.passes.partition_forward import consumers_of
from scheduling.program.capture import Constant, Op, Phase, Program, Value
from scheduling.program.partition_rules import Chunking, Split, chunking
from scheduling.program.uniform_axes import uniform_axes

RAGGED_REFUSAL = (
    "a ragged exchange: its rows are placed by counts known only when the step runs, so "
    "no fixed piece of it is one source's or one chunk's; it runs whole"
)


@dataclass(frozen=True)
class Exchange:
    """A recognised dispatch ``all_to_all`` and its combine (op positions)."""

    dispatch: int
    combine: int
    axis: int  # the split and concat axis
    group: int  # G: devices in the exchange
    # Why it is not decomposed whatever the policy ("" where it may be): RAGGED_REFUSAL.
    refused: str = field(default="", compare=False)

    def layer(self, program: Program) -> str:
        return program.ops[self.dispatch].layer

    def phase(self, program: Program) -> Phase:
        return program.ops[self.dispatch].phase


@dataclass(frozen=True)
class Decomposition:
    kind: str  # "rounds" or "chunks"
    pieces: int
    piece_axis: int  # of the dispatch's operand (rounds: the split axis)

    def __str__(self) -> str:
        return f"{self.kind}:{self.pieces}"


@dataclass
class DecomposedRegion:
    """What an exchange region does, op by op, for one decomposition."""

    exchange: Exchange
    decomposition: Decomposition
    piece_size: int  # P: rows of the piece axis (rounds: G)
    chunked: list[int]  # ops run once per piece (chunks: with A and B)
    replicated: list[int]
    deferred: list[int]
    layouts: dict[Value, Split]
    chunkings: dict[int, Chunking]
    seeds: list[Value] = field(default_factory=list)  # split values cut into pieces
    escaping: list[Value] = field(default_factory=list)  # piece results read elsewhere

    @property
    def begin(self) -> int:
        return self.exchange.dispatch

    @property
    def end(self) -> int:
        return self.exchange.combine + 1


def _is_exchange_half(op: Op) -> bool:
    params = op.eqn.params
    return (
        op.primitive == "all_to_all"
        and params["split_axis"] == params["concat_axis"]
        and not params.get("tiled", False)
        and params.get("axis_index_groups") is None
    )


def _group_size(op: Op, axis_sizes: dict[str, int]) -> int:
    names = op.eqn.params["axis_name"]
    names = names if isinstance(names, tuple | list) else (names,)
    size = 1
    for name in names:
        size *= axis_sizes.get(name, 1)
    return size


def find_exchanges(program: Program) -> list[Exchange]:
    """Every dispatch/combine pair of the program, in program order (see the docstring)."""
    axis_sizes = dict(program.mesh.shape)
    exchanges: list[Exchange] = []
    paired: set[int] = set()
    for a, op in enumerate(program.ops):
        if a in paired or not _is_exchange_half(op):
            continue
        axis = op.eqn.params["split_axis"]
        group = _group_size(op, axis_sizes)
        if group < 2 or op.inputs[0].aval.shape[axis] != group:
            continue
        reached = set(op.outputs)
        for b in range(a + 1, len(program.ops)):
            other = program.ops[b]
            if not any(isinstance(x, Value) and x in reached for x in other.inputs):
                continue
            if other.primitive == "all_to_all":
                same = _is_exchange_half(other) and (
                    other.eqn.params["axis_name"] == op.eqn.params["axis_name"]
                    and other.eqn.params["split_axis"] == axis
                    and other.inputs[0].aval.shape[axis] == group
                )
                if same:
                    ragged = is_ragged_exchange(op) or is_ragged_exchange(other)
                    refused = RAGGED_REFUSAL if ragged else ""
                    exchanges.append(Exchange(a, b, axis, group, refused))
                    paired.add(b)
                break
            reached.update(other.outputs)
    return exchanges


@dataclass
class Layouts:
    """Piece layouts of the values in one span, and how each op there runs on pieces."""

    layouts: dict[Value, Split] = field(default_factory=dict)
    uniform: dict[Value, frozenset[int]] = field(default_factory=dict)
    chunkings: dict[int, Chunking] = field(default_factory=dict)


def propagate(program: Program, seeds: dict[Value, Split], begin: int, end: int) -> Layouts:
    """Layouts of ops ``[begin, end)``: ``seeds`` hold wherever they are produced."""
    result = Layouts()
    produced = {value for op in program.ops[begin:end] for value in op.outputs}
    result.layouts.update({v: s for v, s in seeds.items() if v not in produced})
    for position in range(begin, end):
        op = program.ops[position]
        layouts = [result.layouts.get(a) if isinstance(a, Value) else None for a in op.inputs]
        flat = [
            frozenset(range(len(getattr(a.aval, "shape", ()))))
            if isinstance(a, Constant)
            else result.uniform.get(a, frozenset())
            for a in op.inputs
        ]
        how = chunking(op, layouts, flat)
        if how is not None:
            result.chunkings[position] = how
            result.layouts.update(zip(op.outputs, how.outputs, strict=True))
        elif all(layout is None for layout in layouts):
            for value, axes in zip(op.outputs, uniform_axes(op, flat), strict=True):
                if axes:
                    result.uniform[value] = axes
        for value in op.outputs:
            if value in seeds:
                result.layouts[value] = seeds[value]
    return result


def layer_layouts(
    program: Program, exchanges: list[Exchange], decomposition: Decomposition
) -> Layouts:
    """Layouts over the span of one layer's exchanges, cut along ``decomposition``'s axis."""
    seeds: dict[Value, Split] = {}
    for exchange in exchanges:
        dispatch = program.ops[exchange.dispatch]
        if decomposition.kind == "rounds":
            seeds[dispatch.outputs[0]] = Split(exchange.axis)
        else:
            seeds[dispatch.inputs[0]] = Split(decomposition.piece_axis)
    begin = min(e.dispatch for e in exchanges)
    end = max(e.combine for e in exchanges) + 1
    return propagate(program, seeds, begin, end)


def decompose_region(
    program: Program,
    exchange: Exchange,
    decomposition: Decomposition,
    layouts: Layouts,
    consumers: dict[Value, list[int]] | None = None,
) -> DecomposedRegion | None:
    """``exchange`` in ``decomposition``'s pieces; None where it cannot be."""
    a, b = exchange.dispatch, exchange.combine
    dispatch, combine = program.ops[a], program.ops[b]
    rounds = decomposition.kind == "rounds"
    operand_shape = dispatch.inputs[0].aval.shape
    piece_size = exchange.group if rounds else operand_shape[decomposition.piece_axis]
    if piece_size % decomposition.pieces or (rounds and decomposition.pieces != exchange.group):
        return None
    chunked: list[int] = []
    if not rounds:
        if a not in layouts.chunkings:
            return None
        chunked.append(a)
    region: set[Value] = set(dispatch.outputs)
    replicated: list[int] = []
    deferred: list[int] = []
    deferred_values: set[Value] = set()
    for position in range(a + 1, b):
        op = program.ops[position]
        reads = [x for x in op.inputs if isinstance(x, Value)]
        reads_region = any(x in region for x in reads)
        reads_deferred = any(x in deferred_values for x in reads)
        how = layouts.chunkings.get(position)
        if reads_region and how is not None and how.carry is None and not reads_deferred:
            chunked.append(position)
            region.update(op.outputs)
        elif reads_region or reads_deferred:
            deferred.append(position)
            deferred_values.update(op.outputs)
        else:
            replicated.append(position)
    (returned,) = combine.inputs
    if returned not in region:
        return None
    if rounds:
        if layouts.layouts.get(returned) != Split(exchange.axis):
            return None
    else:
        if b not in layouts.chunkings:
            return None
        chunked.append(b)
        region.update(combine.outputs)
    if not any(program.ops[p].primitive == "dot_general" for p in chunked):
        return None  # no expert computation to overlap
    decomposed = DecomposedRegion(
        exchange,
        decomposition,
        piece_size,
        chunked,
        replicated,
        deferred,
        layouts.layouts,
        layouts.chunkings,
    )
    inside = set(chunked)
    seeds: dict[Value, None] = {}
    for position in chunked:
        how = layouts.chunkings[position]
        for atom, cut in zip(program.ops[position].inputs, how.inputs, strict=True):
            split = layouts.layouts.get(atom) if isinstance(atom, Value) else None
            if cut is not None and atom not in region and split is not None:
                seeds[atom] = None
    decomposed.seeds = list(seeds)
    consumers = consumers_of(program) if consumers is None else consumers
    skip = {b} if rounds else set()  # rounds: B's operand goes back piece by piece
    # In program order (not set order), so that the result is the same from run to run.
    results = [value for p in chunked for value in program.ops[p].outputs]
    decomposed.escaping = [
        value
        for value in results
        if any(r not in inside and r not in skip for r in consumers.get(value, ()))
    ]
    if rounds:  # A's result itself is never whole: any other reader needs it joined
        (received,) = dispatch.outputs
        if any(r not in inside for r in consumers.get(received, ())):
            decomposed.escaping.append(received)
    return decomposed


def candidate_decompositions(
    program: Program, exchange: Exchange, chunk_counts: tuple[int, ...]
) -> list[Decomposition]:
    """``rounds``, and ``chunks:n`` along each other axis of the dispatch operand."""
    shape = program.ops[exchange.dispatch].inputs[0].aval.shape
    found = [Decomposition("rounds", exchange.group, exchange.axis)]
    for axis in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if axis == exchange.axis:
            continue
        found += [Decomposition("chunks", n, axis) for n in chunk_counts if shape[axis] % n == 0]
    return found


def all_decompositions(
    program: Program, chunk_counts: tuple[int, ...]
) -> dict[Exchange, list[DecomposedRegion]]:
    """Every recognised exchange, decomposed in each way that applies (none
    for a refused one)."""
    exchanges = find_exchanges(program)
    # Forward and backward exchanges of one layer share their layouts (the backward cuts
    # the forward's residuals), where their operands have the same shape.
    by_layer: dict[tuple, list[Exchange]] = defaultdict(list)
    for exchange in exchanges:
        if exchange.refused:
            continue
        shape = program.ops[exchange.dispatch].inputs[0].aval.shape
        by_layer[exchange.layer(program), shape, exchange.axis].append(exchange)
    consumers = consumers_of(program)
    found: dict[Exchange, list[DecomposedRegion]] = {exchange: [] for exchange in exchanges}
    for layer_exchanges in by_layer.values():
        options: dict[tuple[str, int], list[Decomposition]] = defaultdict(list)
        for exchange in layer_exchanges:
            for decomposition in candidate_decompositions(program, exchange, chunk_counts):
                key = (decomposition.kind, decomposition.piece_axis)
                if decomposition not in options[key]:
                    options[key].append(decomposition)
        for decompositions in options.values():
            layouts = layer_layouts(program, layer_exchanges, decompositions[0])
            for exchange in layer_exchanges:
                for decomposition in decompositions:
                    decomposed = decompose_region(
                        program, exchange, decomposition, layouts, consumers
                    )
                    if decomposed is not None:
                        found[exchange].append(decomposed)
    return found
