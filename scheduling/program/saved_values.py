"""The forward values that the backward pass reads: a training step's activation memory.

Reverse-mode AD keeps, from the forward pass, every value that the backward pass
needs (the residuals: layer inputs, attention weights, routing masks, ...); they
are all alive when the backward pass begins, whatever order the rest runs in.
Their total, per device, is the step's activation memory as the program defines
it: it follows the model, the batch per device and the parallel layout, and it
includes what a remat region recomputes rather than keeps only if the program
keeps it. Program inputs (parameters, the batch) are not counted: they are the
state's memory, not activations.

It is a count over the captured program, before any compiler runs: XLA may fuse
a cheap residual's producer into the backward pass and recompute it there (less
memory), and it needs working buffers for the op that runs at the peak (more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduling.program.capture import Op, Phase, Program, Value, aval_bytes


@dataclass(frozen=True)
class SavedValues:
    """The forward values read by the backward pass, per device."""

    count: int
    bytes: int


def saved_for_backward(
    program: Program, made_by: Callable[[Op], bool] | None = None
) -> SavedValues:
    """The values made by forward-phase ops (those ``made_by`` accepts, where given) and
    read by backward-phase ops, each once."""
    forward = {
        value
        for op in program.ops
        if op.phase is Phase.FORWARD and (made_by is None or made_by(op))
        for value in op.outputs
    }
    saved = {
        atom
        for op in program.ops
        if op.phase is Phase.BACKWARD
        for atom in op.inputs
        if isinstance(atom, Value) and atom in forward
    }
    return SavedValues(len(saved), sum(aval_bytes(value.aval) for value in saved))
