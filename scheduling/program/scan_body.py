"""A scan's body rebuilt at chunk size, for the scan's chunk copy.

The body's ops were propagated from the scan's operands' layouts
(:mod:`scheduling.program.batch_layout`). At ``1/n`` of the batch each op that
reads the batch runs with its rule's parameters at chunk size, an operand that is
only uniform along the axis its rule cuts is sliced there (as the partitioned
program slices one), and every other op runs as it is. The rebuilt body is traced
once per chunk count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax import lax

from scheduling.program import jax_adapter
from scheduling.program.capture import Atom, Constant, Op, Value
from scheduling.program.partition_rules import chunk_shape

if TYPE_CHECKING:
    from scheduling.program.batch_layout import BatchLayouts


def at_chunk_size(
    ops: Sequence[Op],
    inputs: Sequence[Value],
    outputs: Sequence[Atom],
    layouts: BatchLayouts,
    n: int,
) -> Any:
    """A scan's body, inlined as ``ops`` over ``inputs``, as a ClosedJaxpr at ``1/n`` of the
    batch."""

    def run(*args: Any) -> list[Any]:
        env: dict[Value, Any] = dict(zip(inputs, args, strict=True))

        def read(atom: Atom) -> Any:
            return atom.value if isinstance(atom, Constant) else env[atom]

        for position, op in enumerate(ops):
            how = layouts.chunkings.get(position)
            if how is None:
                results = jax_adapter.bind_equation(op.eqn, [read(a) for a in op.inputs])
            else:
                operands = []
                for atom, cut in zip(op.inputs, how.inputs, strict=True):
                    operand = read(atom)
                    if cut is not None and layouts.layout(atom) is None:
                        operand = lax.slice_in_dim(operand, 0, operand.shape[cut] // n, axis=cut)
                    operands.append(operand)
                results = jax_adapter.bind_equation(op.eqn.replace(params=how.params(n)), operands)
            env.update(zip(op.outputs, results, strict=True))
        return [read(atom) for atom in outputs]

    structs = []
    for value in inputs:
        layout, aval = layouts.layout(value), value.aval
        shape = aval.shape if layout is None else chunk_shape(aval.shape, layout.axis, n)
        structs.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
    return jax.make_jaxpr(run)(*structs)
