"""Batch-layout analysis: where the batch runs through every value of the forward pass.

Starting from the step's batch arguments (their leading axis is the batch),
the layouts are propagated through the forward ops in program order with the
partition rules. The result says, for every value, whether and how it is
split, along which axes it is uniform, and, for every op that can run chunk by
chunk, how. It depends only on the program, not on a range or a chunk count.

A ``scan`` is followed into its body: the body's ops are propagated from the
layouts of the scan's operands (a scanned operand's batch axis one lower), the
carries' layouts taken to a fixed point, and the scan chunks where every body op
that reads the batch chunks and each result is split (the blockwise attention's
loop over tiles, whose tiles keep every row of the batch). Its chunk copy runs
the body rebuilt at chunk size (:mod:`scheduling.program.scan_body`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from scheduling.program import jax_adapter, scan_body
from scheduling.program.capture import Constant, Op, Phase, Program, Value, inline_jaxpr
from scheduling.program.partition_rules import Chunking, Layout, Split, chunking
from scheduling.program.uniform_axes import uniform_axes


@dataclass
class BatchLayouts:
    batch_size: int  # P: examples per device
    layouts: dict[Value, Split] = field(default_factory=dict)
    uniform: dict[Value, frozenset[int]] = field(default_factory=dict)
    chunkings: dict[int, Chunking] = field(default_factory=dict)  # op position -> how

    def layout(self, atom: Value | Constant) -> Layout:
        return self.layouts.get(atom) if isinstance(atom, Value) else None

    def uniform_along(self, atom: Value | Constant) -> frozenset[int]:
        if isinstance(atom, Constant):
            return frozenset(range(len(getattr(atom.aval, "shape", ()))))
        return self.uniform.get(atom, frozenset())


def analyze(program: Program, batch_inputs: Iterable[Value]) -> BatchLayouts:
    """Layouts of the forward pass, with the leading axis of ``batch_inputs`` as the batch."""
    batch_inputs = list(batch_inputs)
    sizes = {value.aval.shape[0] for value in batch_inputs if value.aval.shape}
    if len(sizes) != 1:
        raise ValueError(
            "the batch arguments must all have the same per-device leading axis (the batch); "
            f"got sizes {sorted(sizes)}"
        )
    result = BatchLayouts(batch_size=sizes.pop())
    for value in batch_inputs:
        result.layouts[value] = Split(0)
    _propagate(program.ops, result, forward_only=True)
    return result


def _propagate(ops: Sequence[Op], result: BatchLayouts, *, forward_only: bool = False) -> None:
    """Extend ``result`` over ``ops`` in order (those of the forward pass only, if asked)."""
    for position, op in enumerate(ops):
        if forward_only and op.phase is not Phase.FORWARD:
            continue
        layouts = [result.layout(atom) for atom in op.inputs]
        flat = [result.uniform_along(atom) for atom in op.inputs]
        if op.primitive == "scan" and any(layouts):
            how = _scan(op, layouts, flat, result.batch_size)
        else:
            how = chunking(op, layouts, flat)
        if how is not None:
            result.chunkings[position] = how
            for value, layout in zip(op.outputs, how.outputs, strict=True):
                result.layouts[value] = layout
        elif all(layout is None for layout in layouts):
            for value, axes in zip(op.outputs, uniform_axes(op, flat), strict=True):
                if axes:
                    result.uniform[value] = axes


def _scan(op: Op, layouts: list[Layout], flat: list[frozenset[int]], batch_size: int):
    """How a ``scan`` runs on chunks of the batch, or None (see the module docstring)."""
    params = op.eqn.params
    if params.get("_split_transpose"):
        return None
    body = params["jaxpr"]
    consts, carries = jax_adapter.scan_operands(op.eqn)
    scanned = slice(consts + carries, None)
    if any(layout is not None and layout.axis == 0 for layout in layouts[scanned]):
        return None  # the loop runs along the batch
    inputs = [Value(var.aval) for var in body.jaxpr.invars]
    ops, outputs = inline_jaxpr(body, inputs, "", Phase.FORWARD)
    if any(body_op.is_collective for body_op in ops):
        return None  # rebuilt outside the mesh, the body holds no collective
    # Each carry is split (as its initial value, or as the body makes it), or uniform
    # along the axes that both its initial value and the body keep uniform.
    carried: list[Split | frozenset[int]] = [
        layout if layout is not None else axes
        for layout, axes in zip(layouts[consts:], flat[consts:], strict=False)
    ][:carries]
    for _ in range(2 * carries + 1):  # each round narrows a carry's state, or ends
        analysis = BatchLayouts(batch_size)
        for position, (value, layout, axes) in enumerate(zip(inputs, layouts, flat, strict=True)):
            if consts <= position < consts + carries:
                state = carried[position - consts]
                layout, axes = (state, frozenset()) if isinstance(state, Split) else (None, state)
            elif position >= consts + carries:  # a scanned operand's slice drops axis 0
                layout = None if layout is None else layout.moved(layout.axis - 1)
                axes = frozenset(a - 1 for a in axes if a > 0)
            if layout is not None:
                analysis.layouts[value] = layout
            elif axes:
                analysis.uniform[value] = axes
        _propagate(ops, analysis)
        narrowed = list(carried)
        for index, (state, result) in enumerate(zip(carried, outputs, strict=False)):
            after = analysis.layout(result)
            if isinstance(state, Split):
                if after != state:
                    return None  # a carry loses its split, or changes it
            elif after is not None:
                if (after.outer, after.inner) != (1, 1) or after.axis not in state:
                    return None  # the initial carry cannot be cut there
                narrowed[index] = after
            else:
                narrowed[index] = state & analysis.uniform_along(result)
        if narrowed == carried:
            break
        carried = narrowed
    else:
        return None
    for position, body_op in enumerate(ops):
        reads = any(analysis.layout(atom) is not None for atom in body_op.inputs)
        if reads and position not in analysis.chunkings:
            return None  # an op of the body mixes the batch's rows
    results = [analysis.layout(atom) for atom in outputs]
    if any(layout is None for layout in results):
        return None  # a carry stays whole, or a result of the loop does not hold the batch
    cuts = [None if layout is None else layout.axis for layout in layouts]
    for index, layout in enumerate(results[:carries]):
        cuts[consts + index] = layout.axis
    rebuilt = functools.cache(lambda n: scan_body.at_chunk_size(ops, inputs, outputs, analysis, n))
    return Chunking(
        tuple(cuts),
        (*results[:carries], *(layout.moved(layout.axis + 1) for layout in results[carries:])),
        lambda n: {**params, "jaxpr": rebuilt(n)},
    )
