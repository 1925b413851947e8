"""Parallel folding: the attention layout and the MoE layout, folded onto one mesh.

The devices are numbered ``0 .. N-1`` (row-major over the mesh). Two layouts
split that numbering, each as a mixed radix with its innermost factor first:

- **attention** (and the dense layers): ``tensor`` (Megatron tensor
  parallelism, with sequence parallelism outside the tensor-parallel regions),
  then ``context`` (the sequence split for attention: context parallelism), then
  ``data`` (every other device);
- **MoE**: ``expert_tensor`` (each expert's hidden dimension split), then
  ``expert`` (experts spread, the all-to-all group), then ``expert_data``.

``parallel.data x parallel.expert x parallel.expert_tensor`` is the device
count, so today's ``--parallel.data D --parallel.expert E`` keeps its meaning;
``parallel.tensor`` and ``parallel.context`` only re-read the same devices for
attention.

JAX collectives name mesh axes, not process groups, so each group of either
layout must be a tuple of mesh axes. The mesh is therefore the common
refinement of the two layouts: its axes are the intervals between the cut
points ``{1, tensor, tensor x context, expert_tensor, expert_tensor x expert, N}`` of the
device numbering, which must form a divisibility chain (otherwise some group
is not a set of mesh axes, and :func:`check_layout` says what to change). Each
mesh axis plays one attention role and one MoE role, and is named after them:

=====================  ===============  ====================
mesh axis              attention role   MoE role
=====================  ===============  ====================
data                   data             expert_data
expert                 data             expert
expert_tensor          data             expert_tensor
context                context          expert
context_expert_data    context          expert_data
context_expert_tensor  context          expert_tensor
tensor                 tensor           expert_tensor
tensor_expert          tensor           expert
tensor_expert_data     tensor           expert_data
=====================  ===============  ====================

Without tensor or expert-tensor parallelism the mesh is today's
``(data, expert)``. Under ``parallel.pipeline`` P > 1 those axes fold one pipeline
stage's devices, and one more axis, ``pipeline`` (:data:`PIPELINE`, size P), sits
outermost: it plays no role in either layout (its devices hold different layers and
the same rows), so no group of a role spans stages. This module is arithmetic only
(no JAX), so a config is checked before anything is compiled.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

# Roles of the two layouts.
ATTENTION_DATA = "data"
CONTEXT = "context"
TENSOR = "tensor"
EXPERT_DATA = "expert_data"
EXPERT = "expert"
EXPERT_TENSOR = "expert_tensor"
ATTENTION_ROLES = (ATTENTION_DATA, CONTEXT, TENSOR)
MOE_ROLES = (EXPERT_DATA, EXPERT, EXPERT_TENSOR)
# A parameter dimension split over the tensor group where the group divides it and
# replicated where it does not (key/value heads fewer than the tensor devices).
TENSOR_IF_DIVIDES = "tensor_if_divides"

# (attention role, MoE role) -> mesh axis name; see the table in the module docstring.
AXIS_NAMES = {
    (ATTENTION_DATA, EXPERT_DATA): "data",
    (ATTENTION_DATA, EXPERT): "expert",
    (ATTENTION_DATA, EXPERT_TENSOR): "expert_tensor",
    (CONTEXT, EXPERT): "context",
    (CONTEXT, EXPERT_DATA): "context_expert_data",
    (CONTEXT, EXPERT_TENSOR): "context_expert_tensor",
    (TENSOR, EXPERT_TENSOR): "tensor",
    (TENSOR, EXPERT): "tensor_expert",
    (TENSOR, EXPERT_DATA): "tensor_expert_data",
}
AXIS_ROLES = {name: roles for roles, name in AXIS_NAMES.items()}
# The outermost mesh axis under a pipeline: each of its indices is one stage.
PIPELINE = "pipeline"
# Always in the mesh (size 1 when unused), so that code and specs written for the
# (data, expert) mesh keep working on every layout.
ALWAYS_PRESENT = ("data", "expert")


class LayoutError(ValueError):
    """A parallel layout that cannot be folded onto one mesh (raised as a ConfigError)."""


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int
    stride: int  # distance in the device numbering between neighbours along this axis


def check_layout(
    devices: int, tensor: int, expert: int, expert_tensor: int, context: int = 1
) -> None:
    """Raise :class:`LayoutError` naming the fields when the two layouts do not fold."""
    moe_group = expert * expert_tensor
    sequence_group = tensor * context
    if context == 1:
        sequence, splits = f"parallel.tensor={tensor}", "tensor, "
    else:
        sequence = f"parallel.tensor={tensor} x parallel.context={context}"
        splits = f"tensor, tensor x context (= {sequence_group}), "
    if devices % sequence_group:
        raise LayoutError(
            f"{sequence} does not divide the {devices} devices (parallel.data x "
            "parallel.expert x parallel.expert_tensor): choose sizes whose product divides "
            f"{devices}"
        )
    cuts = sorted({1, tensor, sequence_group, expert_tensor, moe_group, devices})
    for inner, outer in itertools.pairwise(cuts):
        if outer % inner:
            raise LayoutError(
                f"{sequence} does not fold with parallel.expert_tensor={expert_tensor} x "
                f"parallel.expert={expert}: each of {splits}expert_tensor and "
                f"expert_tensor x expert (= {moe_group}) must divide the next larger one "
                f"(here {inner} does not divide {outer}), so that every group is a set of "
                "mesh axes; choose sizes that nest, e.g. powers of two"
            )


def mesh_axes(
    data: int,
    tensor: int,
    expert: int,
    expert_tensor: int,
    pipeline: int = 1,
    context: int = 1,
) -> tuple[MeshAxis, ...]:
    """The folded mesh's axes, outermost (largest stride) first; under a pipeline
    (``pipeline`` > 1) the ``pipeline`` axis, then a stage's."""
    devices = data * expert * expert_tensor
    stages = (MeshAxis(PIPELINE, pipeline, devices),) if pipeline > 1 else ()
    return (*stages, *_stage_axes(data, tensor, expert, expert_tensor, context))


def _stage_axes(
    data: int, tensor: int, expert: int, expert_tensor: int, context: int
) -> tuple[MeshAxis, ...]:
    """The axes folding one stage's ``data x expert x expert_tensor`` devices."""
    devices = data * expert * expert_tensor
    check_layout(devices, tensor, expert, expert_tensor, context)
    cuts = sorted({1, tensor, tensor * context, expert_tensor, expert * expert_tensor, devices})
    axes = []
    for inner, outer in itertools.pairwise(cuts):
        if outer <= tensor:
            attention_role = TENSOR
        elif outer <= tensor * context:
            attention_role = CONTEXT
        else:
            attention_role = ATTENTION_DATA
        if outer <= expert_tensor:
            moe_role = EXPERT_TENSOR
        elif outer <= expert * expert_tensor:
            moe_role = EXPERT
        else:
            moe_role = EXPERT_DATA
        axes.append(MeshAxis(AXIS_NAMES[attention_role, moe_role], outer // inner, inner))
    present = {axis.name for axis in axes}
    # Size-1 placeholders sit outermost; a size-1 axis has no place in the numbering.
    missing = [MeshAxis(name, 1, devices) for name in ALWAYS_PRESENT if name not in present]
    return (*missing, *reversed(axes))


def axes_for_role(role: str, axis_names: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes (of ``axis_names``, in their order) that make up a group of ``role``."""
    if role == TENSOR_IF_DIVIDES:
        role = TENSOR
    if role not in ATTENTION_ROLES + MOE_ROLES:
        raise ValueError(f"unknown role {role!r}: one of {ATTENTION_ROLES + MOE_ROLES}")
    return tuple(name for name in axis_names if name in AXIS_ROLES and role in AXIS_ROLES[name])


def contiguous_positions(seq_len: int, context: int, tensor: int) -> int:
    """The longest run that every device's share of a row is cut into, as positions of
    the row (:mod:`jaxmoe.parallel.sequence_split`): its two chunks' and its tensor slice's
    lengths' greatest common divisor; the whole share without context parallelism."""
    share = seq_len // (context * tensor)
    return share if context == 1 else math.gcd(seq_len // (2 * context), share)


def check_split_widths(
    *,
    tensor: int,
    expert_tensor: int,
    seq_len: int,
    num_heads: int,
    context: int = 1,
    d_ff: int,
    d_expert: int,
    d_expert_field: str = "moe.d_expert",
    kv_heads: int | None = None,
    d_shared: int = 0,
    d_shared_field: str = "moe.d_shared_expert",
) -> None:
    """Raise :class:`LayoutError` when a split dimension does not divide evenly.

    Key/value heads (``kv_heads``) are split over the tensor group where it divides them
    and replicated where there are fewer of them than tensor devices; then the group
    must be a multiple of them, so that each device's query heads read one of them."""
    splits = (
        ("model.seq_len", seq_len, "parallel.tensor", tensor, "sequence parallelism"),
        ("model.num_heads", num_heads, "parallel.tensor", tensor, "heads split"),
        ("model.d_ff", d_ff, "parallel.tensor", tensor, "dense FFN hidden split"),
        (d_expert_field, d_expert, "parallel.expert_tensor", expert_tensor, "expert hidden split"),
        (d_shared_field, d_shared, "parallel.tensor", tensor, "shared experts hidden split"),
    )
    if context > 1:
        splits = (
            ("model.seq_len", seq_len, "2 x parallel.context", 2 * context, "two chunks a "
             "device of the context group"),
            ("model.seq_len / parallel.context", seq_len // context,
             "parallel.tensor", tensor, "sequence parallelism inside the context group"),
            *splits[1:],
        )  # fmt: skip
    for field, size, axis_field, ways, what in splits:
        if size % ways:
            raise LayoutError(
                f"{field}={size} is not divisible by {axis_field}={ways} ({what}): choose a "
                f"{axis_field} that divides {size}, or make {field} a multiple of {ways}"
            )
    if kv_heads is not None and kv_heads % tensor and tensor % kv_heads:
        raise LayoutError(
            f"model.num_kv_heads={kv_heads} and parallel.tensor={tensor}: key/value heads are "
            "split over the tensor group when it divides them, and replicated when it is a "
            "multiple of them; choose a parallel.tensor that divides or is divided by "
            f"{kv_heads}"
        )
