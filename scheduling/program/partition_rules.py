"""Partition rules: how a batch axis passes through each primitive.

A value is *split* when one of its axes carries the batch: ``Split(axis,
outer, inner)`` says that axis has size ``outer * P * inner`` and, read as
``[outer, P, inner]``, its middle factor is the batch (``P`` examples). Chunk
``c`` of ``n`` holds batch rows ``[c * P / n, (c + 1) * P / n)`` at every outer
and inner position. Plain batch-major values are ``Split(axis, 1, 1)``; after
a reshape that merges the batch with a later axis the inner factor grows, and
after an all-to-all that gathers from ``k`` devices along that axis the outer
factor is ``k``.

A rule takes one op and the layouts of its operands and says whether the op
can run chunk by chunk, computing exactly the rows of its result that belong
to the chunk: which operands are cut (and along which axis), the layouts of
its results, and the op's parameters at chunk size. An op that mixes rows of
different examples (a reduction over the batch axis, a sort along it) has no
rule: it cannot be chunked.

A value that is not split may still be *uniform* along some axes (the same
along them: broadcasts, iotas, masks built from them); a chunked op can then
take any ``1/n`` slice of it along such an axis.

Collectives are per-device programs too: when every device runs the same chunk,
an all-gather, reduce-scatter or all-reduce along an axis other than the batch
(the sequence of a tensor-parallel block, over its tuple of mesh axes) makes
exactly the rows of its result that belong to the chunk. Along the batch axis
they do only where the devices' blocks are whole outer factors.

Prefix operations along the batch axis (``cumsum``, ``cumprod``, ``cummax``,
``cummin``) are chunked with a carry: each chunk's prefix plus the running
total of the chunks before it.

cuDNN's fused attention (``dot_product_attention_fwd``/``bwd``) runs row by row of the
batch and chunks along it. A ``scan`` (the blockwise attention's loop over tiles) chunks
where every op of its body does, by these rules (:mod:`scheduling.program.batch_layout`
follows the batch into the body; :mod:`scheduling.program.scan_body` rebuilds it at chunk
size). ``dynamic_update_slice`` chunks where the update covers the whole batch axis (a
loop's tile written into its carry).

Ragged ops (``ragged_dot_general``, a grouped GEMM; ``ragged_all_to_all``) are refused
(:func:`_ragged`): their rows are grouped by sizes known only when the step runs, so
no chunk of the batch is a fixed block of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from scheduling.program.capture import Op

ELEMENTWISE = frozenset(
    {
        "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
        "cbrt", "ceil", "clamp", "clz", "convert_element_type", "copy", "copy_p", "cos", "cosh",
        "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge",
        "gt", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "log2", "logistic", "lt",
        "max", "min", "mul", "ne", "neg", "nextafter", "not", "one_minus_square", "or",
        "polynomial", "population_count", "pow", "pvary", "reduce_precision", "rem", "round",
        "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign",
        "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
    }
)  # fmt: skip
REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
     "reduce_xor", "argmax", "argmin"}
)  # fmt: skip
# Prefix operations that chunk along the batch axis with a carry, and how the carry
# (the last prefix of the chunk before) combines with a chunk's own prefix.
PREFIX_COMBINE = {"cumsum": "add", "cumprod": "mul", "cummax": "max", "cummin": "min"}
PREFIXES = frozenset(PREFIX_COMBINE) | {"cumlogsumexp"}


@dataclass(frozen=True)
class Split:
    """The batch runs along ``axis``, as the middle factor of ``[outer, P, inner]``."""

    axis: int
    outer: int = 1
    inner: int = 1

    def moved(self, axis: int, outer: int | None = None, inner: int | None = None) -> Split:
        return Split(
            axis, self.outer if outer is None else outer, self.inner if inner is None else inner
        )


Layout = Split | None


@dataclass(frozen=True)
class Chunking:
    """How one op runs on chunks.

    ``inputs[i]`` is the axis along which operand ``i`` is cut (its chunk, if it is
    split; a slice, if it is uniform there), or None when every chunk reads all of it.
    ``params(n)`` are the op's parameters for a ``1/n`` chunk. ``carry`` names how a
    prefix op combines its chunk's result with the previous chunk's last prefix.
    """

    inputs: tuple[int | None, ...]
    outputs: tuple[Split, ...]
    params: Callable[[int], dict[str, Any]]
    carry: str | None = None


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _same_params(op: Op) -> Callable[[int], dict[str, Any]]:
    return lambda n: dict(op.eqn.params)


def _with_param(op: Op, name: str, value: Callable[[int], Any]) -> Callable[[int], dict[str, Any]]:
    return lambda n: {**op.eqn.params, name: value(n)}


def chunk_shape(shape: Sequence[int], axis: int, n: int) -> tuple[int, ...]:
    """The shape of one of ``n`` chunks cut along ``axis``."""
    return tuple(size // n if i == axis else size for i, size in enumerate(shape))


def _one_split(layouts: Sequence[Layout]) -> Split | None:
    """The common split of the operands, or None when they disagree (or none is split)."""
    splits = {layout for layout in layouts if layout is not None}
    return splits.pop() if len(splits) == 1 else None


def _elementwise(op: Op, layouts, uniform) -> Chunking | None:
    split = _one_split(layouts)
    if split is None:
        return None
    out_shape = _shape(op.outputs[0])
    size = out_shape[split.axis]
    cuts: list[int | None] = []
    for atom, layout, flat in zip(op.inputs, layouts, uniform, strict=True):
        shape = _shape(atom)
        if layout is not None:
            if len(shape) != len(out_shape):
                return None
            cuts.append(split.axis)
        elif len(shape) == 0 or shape[split.axis] == 1:
            cuts.append(None)  # broadcast along the batch: every chunk reads all of it
        elif shape[split.axis] == size and split.axis in flat:
            cuts.append(split.axis)
        else:
            return None
    return Chunking(tuple(cuts), (split,) * len(op.outputs), _same_params(op))


def _broadcast_in_dim(op: Op, layouts, uniform) -> Chunking | None:
    (layout, *rest) = layouts
    if layout is None or any(r is not None for r in rest):
        return None
    axis = op.eqn.params["broadcast_dimensions"][layout.axis]
    return Chunking(
        (layout.axis,) + (None,) * len(rest),
        (layout.moved(axis),),
        _with_param(op, "shape", lambda n: chunk_shape(op.eqn.params["shape"], axis, n)),
    )


def _reshape(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    if layout is None or op.eqn.params.get("dimensions") is not None:
        return None
    in_shape, out_shape = _shape(op.inputs[0]), _shape(op.outputs[0])
    batch = in_shape[layout.axis] // (layout.outer * layout.inner)
    # Row-major position of the batch factor: its stride in elements.
    stride = layout.inner
    for size in in_shape[layout.axis + 1 :]:
        stride *= size
    out_stride = 1
    for axis in reversed(range(len(out_shape))):
        size = out_shape[axis]
        if stride % out_stride == 0:
            inner = stride // out_stride
            if size % (inner * batch) == 0:
                split = Split(axis, size // (inner * batch), inner)
                return Chunking(
                    (layout.axis,),
                    (split,),
                    _with_param(
                        op, "new_sizes", lambda n, axis=axis: chunk_shape(out_shape, axis, n)
                    ),
                )
        out_stride *= size
        if out_stride > stride:
            break
    return None  # the batch factor straddles two result axes


def _transpose(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    if layout is None:
        return None
    axis = list(op.eqn.params["permutation"]).index(layout.axis)
    return Chunking((layout.axis,), (layout.moved(axis),), _same_params(op))


def _squeeze(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    if layout is None:
        return None
    dropped = op.eqn.params["dimensions"]
    axis = layout.axis - sum(d < layout.axis for d in dropped)
    return Chunking((layout.axis,), (layout.moved(axis),), _same_params(op))


def _reduction(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    if layout is None or layout.axis in op.eqn.params["axes"]:
        return None  # reducing across examples
    axis = layout.axis - sum(d < layout.axis for d in op.eqn.params["axes"])
    return Chunking((layout.axis,), (layout.moved(axis),) * len(op.outputs), _same_params(op))


def _along_other_axis(param: str):
    """Ops that work along one axis (``param``) and are row-wise along every other."""

    def rule(op: Op, layouts, uniform) -> Chunking | None:
        split = _one_split(layouts)
        if split is None or any(layout is None for layout in layouts):
            return None
        if op.eqn.params[param] == split.axis:
            return None
        return Chunking((split.axis,) * len(layouts), (split,) * len(op.outputs), _same_params(op))

    return rule


def _prefix(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    if layout is None:
        return None
    if op.eqn.params["axis"] != layout.axis:
        return Chunking((layout.axis,), (layout,), _same_params(op))
    combine = PREFIX_COMBINE.get(op.primitive)
    if combine is None or op.eqn.params.get("reverse") or layout.outer != 1:
        return None  # a chunk must be a contiguous run along the prefix axis
    return Chunking((layout.axis,), (layout,), _same_params(op), carry=combine)


def _dot_general(op: Op, layouts, uniform) -> Chunking | None:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = op.eqn.params["dimension_numbers"]
    lhs, rhs = layouts
    lhs_rank, rhs_rank = len(_shape(op.inputs[0])), len(_shape(op.inputs[1]))
    lhs_free = [d for d in range(lhs_rank) if d not in lhs_contract and d not in lhs_batch]
    rhs_free = [d for d in range(rhs_rank) if d not in rhs_contract and d not in rhs_batch]
    # Result axes: batch dimensions, then lhs free, then rhs free.
    if lhs is not None and rhs is not None:
        if lhs.axis not in lhs_batch or (lhs.outer, lhs.inner) != (rhs.outer, rhs.inner):
            return None
        position = list(lhs_batch).index(lhs.axis)
        if rhs_batch[position] != rhs.axis:
            return None
        return Chunking((lhs.axis, rhs.axis), (lhs.moved(position),), _same_params(op))
    if lhs is not None and lhs.axis in lhs_free:
        axis = len(lhs_batch) + lhs_free.index(lhs.axis)
        return Chunking((lhs.axis, None), (lhs.moved(axis),), _same_params(op))
    if rhs is not None and rhs.axis in rhs_free:
        axis = len(rhs_batch) + len(lhs_free) + rhs_free.index(rhs.axis)
        return Chunking((None, rhs.axis), (rhs.moved(axis),), _same_params(op))
    return None  # contracted over the batch, or a batch dimension of one operand only


def _slice(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    if layout is None:
        return None
    params = op.eqn.params
    axis = layout.axis
    size = _shape(op.inputs[0])[axis]
    strides = params.get("strides") or (1,) * len(params["start_indices"])
    if params["start_indices"][axis] != 0 or params["limit_indices"][axis] != size:
        return None
    if strides[axis] != 1:
        return None
    return Chunking(
        (axis,),
        (layout,),
        _with_param(op, "limit_indices", lambda n: chunk_shape(params["limit_indices"], axis, n)),
    )


def _dynamic_slice(op: Op, layouts, uniform) -> Chunking | None:
    """A slice along other axes (a device's slice of the sequence, say): the batch passes
    through when the slice keeps all of it. A start index there is then clamped to 0
    whatever it is, so every chunk takes its whole chunk."""
    layout, *indices = layouts
    if layout is None or any(index is not None for index in indices):
        return None
    axis = layout.axis
    sizes = op.eqn.params["slice_sizes"]
    if sizes[axis] != _shape(op.inputs[0])[axis]:
        return None
    return Chunking(
        (axis, *(None for _ in indices)),
        (layout,),
        _with_param(op, "slice_sizes", lambda n: chunk_shape(sizes, axis, n)),
    )


def _dynamic_update_slice(op: Op, layouts, uniform) -> Chunking | None:
    """An update along other axes (a tile written into a loop's carry): the batch passes
    through when the update covers all of it; its start index there is then clamped to 0.
    An operand that is not split (zeros to write into) is cut where it is uniform."""
    operand, update, *indices = layouts
    split = _one_split((operand, update))
    if split is None or any(index is not None for index in indices):
        return None
    axis = split.axis
    if _shape(op.inputs[1])[axis] != _shape(op.inputs[0])[axis]:
        return None
    for layout, flat in zip((operand, update), uniform, strict=False):
        if layout is None and axis not in flat:
            return None
    return Chunking((axis, axis, *(None for _ in indices)), (split,), _same_params(op))


def _pad(op: Op, layouts, uniform) -> Chunking | None:
    layout, padding_value = layouts
    if layout is None or padding_value is not None:
        return None
    if tuple(op.eqn.params["padding_config"][layout.axis]) != (0, 0, 0):
        return None
    return Chunking((layout.axis, None), (layout,), _same_params(op))


def _concatenate(op: Op, layouts, uniform) -> Chunking | None:
    split = _one_split(layouts)
    if split is None or op.eqn.params["dimension"] == split.axis:
        return None
    for layout, flat in zip(layouts, uniform, strict=True):
        if layout is None and split.axis not in flat:
            return None
    return Chunking((split.axis,) * len(layouts), (split,), _same_params(op))


def _split(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    if layout is None or op.eqn.params["axis"] == layout.axis:
        return None
    return Chunking((layout.axis,), (layout,) * len(op.outputs), _same_params(op))


def _rev(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    if layout is None or layout.axis in op.eqn.params["dimensions"]:
        return None
    return Chunking((layout.axis,), (layout,), _same_params(op))


def _all_to_all(op: Op, layouts, uniform) -> Chunking | None:
    (layout,) = layouts
    params = op.eqn.params
    if layout is None or layout.axis in (params["split_axis"], params["concat_axis"]):
        return None
    return Chunking((layout.axis,), (layout,), _same_params(op))


def _all_gather(op: Op, layouts, uniform) -> Chunking | None:
    """Every device gathers the same chunk of its rows: a chunk of the gathered result.

    Along another axis (a sequence gathered over the tensor axes) the batch stays
    where it is; an untiled gather inserts the group axis. Gathered tiled along the
    batch axis, the devices' pieces follow one another: ``k`` more outer blocks.
    """
    (layout,) = layouts
    if layout is None:
        return None
    params = op.eqn.params
    dim, group = params["all_gather_dimension"], params["axis_size"]
    if not params["tiled"]:
        out = layout.moved(layout.axis + (dim <= layout.axis))
    elif dim == layout.axis:
        out = layout.moved(layout.axis, outer=layout.outer * group)
    else:
        out = layout
    return Chunking((layout.axis,), (out,), _same_params(op))


def _reduce_scatter(op: Op, layouts, uniform) -> Chunking | None:
    """Summed across devices elementwise, then cut along ``scatter_dimension``.

    Cut along another axis (the sequence, back to its slice) each chunk's rows stay
    whole. Cut along the batch axis, device ``i`` keeps block ``i`` of the axis: that
    commutes with taking rows only when the blocks are whole outer blocks (``outer``
    a multiple of the group); otherwise device ``i`` would keep different examples of
    each chunk than of the whole batch, so it has no rule.
    """
    (layout,) = layouts
    if layout is None:
        return None
    params = op.eqn.params
    dim, group = params["scatter_dimension"], params["axis_size"]
    if dim != layout.axis:
        axis = layout.axis if params["tiled"] else layout.axis - (dim < layout.axis)
        return Chunking((layout.axis,), (layout.moved(axis),), _same_params(op))
    if not params["tiled"] or layout.outer % group:
        return None
    return Chunking(
        (layout.axis,), (layout.moved(layout.axis, outer=layout.outer // group),), _same_params(op)
    )


def _each_operand_alike(op: Op, layouts, uniform) -> Chunking | None:
    """psum and its kin reduce across devices elementwise, and an optimization_barrier
    passes each operand on as its result: every operand chunked alike, and its result."""
    if any(layout is None for layout in layouts):
        return None  # an unsplit operand would be reduced once per chunk
    return Chunking(tuple(layout.axis for layout in layouts), tuple(layouts), _same_params(op))


def _gather(op: Op, layouts, uniform) -> Chunking | None:
    operand, indices = layouts
    numbers = op.eqn.params["dimension_numbers"]
    indices_rank = len(_shape(op.inputs[1]))
    out_rank = len(_shape(op.outputs[0]))
    # Result axes that are not offset axes follow the indices' axes (but the last,
    # which holds the index vector), in order.
    batch_axes = [d for d in range(out_rank) if d not in numbers.offset_dims]
    if indices is not None:
        if indices.axis == indices_rank - 1:
            return None
        axis = batch_axes[indices.axis]
        if operand is None:
            if indices.axis in numbers.start_indices_batching_dims:
                return None
            return Chunking((None, indices.axis), (indices.moved(axis),), _same_params(op))
        if indices.axis not in numbers.start_indices_batching_dims:
            return None
        position = list(numbers.start_indices_batching_dims).index(indices.axis)
        if numbers.operand_batching_dims[position] != operand.axis or (
            operand.outer,
            operand.inner,
        ) != (indices.outer, indices.inner):
            return None
        # A batching axis has slice size 1: the parameters stay as they are.
        return Chunking((operand.axis, indices.axis), (indices.moved(axis),), _same_params(op))
    if operand is None:
        return None
    # Operand split along a window axis that is taken whole: an offset axis of the result.
    slice_sizes = op.eqn.params["slice_sizes"]
    if (
        operand.axis in numbers.collapsed_slice_dims
        or operand.axis in numbers.start_index_map
        or operand.axis in numbers.operand_batching_dims
        or slice_sizes[operand.axis] != _shape(op.inputs[0])[operand.axis]
    ):
        return None
    window_axes = [
        d
        for d in range(len(slice_sizes))
        if d not in numbers.collapsed_slice_dims and d not in numbers.operand_batching_dims
    ]
    axis = numbers.offset_dims[window_axes.index(operand.axis)]
    return Chunking(
        (operand.axis, None),
        (operand.moved(axis),),
        _with_param(op, "slice_sizes", lambda n: chunk_shape(slice_sizes, operand.axis, n)),
    )


def _scatter(op: Op, layouts, uniform) -> Chunking | None:
    """Each row's updates written into its own operand's row, along a batching axis of the
    indices. An operand or updates that are not split (zeros to write into, positions
    ``0 .. n``) are cut where they are uniform."""
    operand, indices, updates = layouts
    numbers = op.eqn.params["dimension_numbers"]
    if indices is None:
        return None
    if indices.axis not in numbers.scatter_indices_batching_dims:
        return None
    position = list(numbers.scatter_indices_batching_dims).index(indices.axis)
    operand_axis = numbers.operand_batching_dims[position]
    if operand is None and operand_axis not in uniform[0]:
        return None
    if operand is not None and (operand.axis, operand.outer, operand.inner) != (
        operand_axis,
        indices.outer,
        indices.inner,
    ):
        return None
    update_rank = len(_shape(op.inputs[2]))
    scatter_axes = [d for d in range(update_rank) if d not in numbers.update_window_dims]
    update_axis = scatter_axes[indices.axis]
    if updates is None and update_axis not in uniform[2]:
        return None
    if updates is not None and updates.axis != update_axis:
        return None
    return Chunking(
        (operand_axis, indices.axis, update_axis),
        (indices.moved(operand_axis),),
        _same_params(op),
    )


def _fused_attention(op: Op, layouts, uniform) -> Chunking | None:
    """cuDNN's fused attention, forward or backward: every operand and result batch-major
    (queries, keys, values ``[batch, seq, heads, dim]``, sequence lengths ``[batch]``, the
    softmax statistics ``[batch, heads, seq]``), each row's attention its own. Chunked
    along the batch where the batch is the whole leading axis; placeholders (an absent
    bias, empty offsets) are read whole."""
    split = _one_split(layouts)
    if split is None or split != Split(0):
        return None
    batch = _shape(op.outputs[0])[0]
    cuts: list[int | None] = []
    for atom, layout, flat in zip(op.inputs, layouts, uniform, strict=True):
        shape = _shape(atom)
        if layout is not None:
            cuts.append(0)
        elif not shape or math.prod(shape) == 0 or shape[0] == 1:
            cuts.append(None)
        elif shape[0] == batch and 0 in flat:
            cuts.append(0)
        else:
            return None
    if any(not _shape(v) or _shape(v)[0] != batch for v in op.outputs):
        return None
    return Chunking(tuple(cuts), (split,) * len(op.outputs), _same_params(op))


def _ragged(op: Op, layouts, uniform) -> Chunking | None:
    """Refused: rows grouped by run-time sizes hold no fixed block of the batch."""
    return None


RULES: dict[str, Callable[[Op, Sequence[Layout], Sequence[frozenset[int]]], Chunking | None]] = {
    **dict.fromkeys(ELEMENTWISE, _elementwise),
    **dict.fromkeys(REDUCTIONS, _reduction),
    **dict.fromkeys(PREFIXES, _prefix),
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "dot_general": _dot_general,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "pad": _pad,
    "concatenate": _concatenate,
    "split": _split,
    "rev": _rev,
    "top_k": _along_other_axis("axis"),
    "sort": _along_other_axis("dimension"),
    "all_to_all": _all_to_all,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    **dict.fromkeys(("psum", "psum_invariant", "pmax", "pmin"), _each_operand_alike),
    "optimization_barrier": _each_operand_alike,
    "gather": _gather,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter": _scatter,
    "ragged_dot_general": _ragged,
    "ragged_all_to_all": _ragged,
    # cuDNN's flash attention (jax.nn.dot_product_attention on a GPU).
    "dot_product_attention_fwd_wrapper": _fused_attention,
    "dot_product_attention_bwd_wrapper": _fused_attention,
}


def chunking(
    op: Op, layouts: Sequence[Layout], uniform: Sequence[frozenset[int]]
) -> Chunking | None:
    """How ``op`` runs on chunks, given its operands' layouts; None when it cannot."""
    if all(layout is None for layout in layouts):
        return None
    rule = RULES.get(op.primitive)
    if rule is None or op.is_opaque:
        return None
    return rule(op, layouts, uniform)
