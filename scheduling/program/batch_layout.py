"""Batch-layout analysis: where the batch runs through every value of the forward pass.

Starting from the step's batch arguments (their leading axis is the batch),
the layouts are propagated through the forward ops in program order with the
partition rules. The result says, for every value, whether and how it is
split, along which axes it is uniform, and, for every op that can run chunk by
chunk, how. It depends only on the program, not on a range or a chunk count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduling.program.capture import Constant, Phase, Program, Value
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
    for position, op in enumerate(program.ops):
        if op.phase is not Phase.FORWARD:
            continue
        layouts = [result.layout(atom) for atom in op.inputs]
        flat = [result.uniform_along(atom) for atom in op.inputs]
        how = chunking(op, layouts, flat)
        if how is not None:
            result.chunkings[position] = how
            for value, layout in zip(op.outputs, how.outputs, strict=True):
                result.layouts[value] = layout
        elif all(layout is None for layout in layouts):
            for value, axes in zip(op.outputs, uniform_axes(op, flat), strict=True):
                if axes:
                    result.uniform[value] = axes
    return result
