"""Uniform axes: along which axes an unsplit value is the same everywhere.

Broadcasts, iotas and the masks built from them are uniform along the axes they
were broadcast over, and so are their transposes, reshapes, slices and elementwise
results along the axes that carry those (and an update written into a uniform value
where both are uniform along an axis the update covers whole); a chunked op may take
any ``1/n`` slice of such a value along them (see :mod:`scheduling.program.partition_rules`).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.program.capture import Op
from scheduling.program.partition_rules import ELEMENTWISE


def _shape(atom) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def uniform_axes(op: Op, uniform: Sequence[frozenset[int]]) -> list[frozenset[int]]:
    """Axes along which each result of an unsplit op is the same everywhere."""
    out_shapes = [tuple(getattr(v.aval, "shape", ())) for v in op.outputs]
    params = op.eqn.params
    if op.primitive == "iota":
        return [frozenset(range(len(out_shapes[0]))) - {params["dimension"]}]
    if op.primitive == "broadcast_in_dim":
        dims = params["broadcast_dimensions"]
        in_shape = _shape(op.inputs[0])
        flat = {dims[d] for d in uniform[0]} | {dims[d] for d, s in enumerate(in_shape) if s == 1}
        return [frozenset(range(len(out_shapes[0]))) - set(dims) | flat]
    if op.primitive in ELEMENTWISE:
        (shape,) = out_shapes
        flat = set(range(len(shape)))
        for atom, axes in zip(op.inputs, uniform, strict=True):
            in_shape = _shape(atom)
            if len(in_shape) == len(shape):
                flat &= set(axes) | {d for d, s in enumerate(in_shape) if s == 1}
        return [frozenset(flat)]
    if op.primitive == "transpose":
        permutation = params["permutation"]
        return [frozenset(i for i, d in enumerate(permutation) if d in uniform[0])]
    if op.primitive in ("reshape", "squeeze"):
        return [_reshaped(_shape(op.inputs[0]), out_shapes[0], uniform[0])]
    if op.primitive in ("slice", "dynamic_slice"):  # any part of a uniform value is uniform
        return [uniform[0] | {d for d, size in enumerate(out_shapes[0]) if size == 1}]
    if op.primitive == "dynamic_update_slice":
        # Along an axis the update covers whole, each position is the operand's or the
        # update's all along it.
        (shape,), update = out_shapes, _shape(op.inputs[1])
        flat = {d for d in uniform[0] & uniform[1] if update[d] == shape[d]}
        return [frozenset(flat | {d for d, size in enumerate(shape) if size == 1})]
    return [frozenset() for _ in op.outputs]


def _reshaped(
    in_shape: tuple[int, ...], out_shape: tuple[int, ...], axes: frozenset[int]
) -> frozenset[int]:
    """The uniform axes of a reshape's result: all of them where the operand is the same
    everywhere; where the reshape only adds or drops axes of size 1, the operand's uniform
    axes (and every axis of size 1); else none."""
    if all(d in axes or size == 1 for d, size in enumerate(in_shape)):
        return frozenset(range(len(out_shape)))
    kept_in = [d for d, size in enumerate(in_shape) if size != 1]
    kept_out = [d for d, size in enumerate(out_shape) if size != 1]
    if [in_shape[d] for d in kept_in] != [out_shape[d] for d in kept_out]:
        return frozenset()
    ones = {d for d, size in enumerate(out_shape) if size == 1}
    return frozenset(o for i, o in zip(kept_in, kept_out, strict=True) if i in axes) | ones
