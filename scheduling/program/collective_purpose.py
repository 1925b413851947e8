"""What each collective of a program is for, read from the program alone.

Two things in an equation say it: the name scopes on its name stack (the model
wraps its blocks in ``attention``, ``ffn``, ``moe``, the gradient reductions in
``grad_reduce/...``), and the mesh axes it runs over. A mesh axis of a folded
layout plays one role in the attention layout and one in the MoE layout
(:class:`AxisRoles`, which the caller passes: jaxmoe's folded mesh names
``tensor_expert`` the axis that is tensor for attention and expert for the MoE;
without roles, an axis plays the role of its own name). A collective inside an
MoE block names its group by the MoE roles of its axes, elsewhere by the
attention roles:

- ``tensor all_gather (sequence)`` / ``tensor reduce_scatter (sequence)``: the
  entry and exit of a sequence-parallel block (gathered or scattered along an
  axis other than the last, the features);
- ``expert all_to_all (dispatch)`` / ``(combine)``: an MoE layer's exchange out
  to the experts and back; which is which follows the data flow (a combine
  reads what a dispatch of its layer sent; in the backward pass the order is
  reversed);
- ``expert-tensor all_gather``: around the expert GEMMs of split experts;
- ``context ppermute (ring)`` / ``context all_gather (keys and values)``: context
  parallelism's exchange of attention's keys and values, a block at a time around the
  ring, or all at once;
- ``gradient psum``: anything under ``grad_reduce``;
- ``parameter all_gather``: anything under ``param_gather`` (sharded weights gathered
  before use).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduling.names import PARAMETER_GATHER_SCOPE
from scheduling.program.capture import Op, Phase, Program, Value

# Scopes that say which layout a block runs in, or what a collective outside the
# blocks does.
MOE_SCOPES = frozenset({"moe"})
DENSE_SCOPES = frozenset({"attention", "ffn", "dense", "mlp", "head"})
TASK_SCOPES = {
    "grad_reduce": "gradient",
    PARAMETER_GATHER_SCOPE: "parameter",
    "clip": "gradient-norm",
    "metrics": "metrics",
}
ROLE_NAMES = {
    "data": "data",
    "tensor": "tensor",
    "context": "context",
    "expert": "expert",
    "expert_tensor": "expert-tensor",
    "expert_data": "expert-data",
}


@dataclass(frozen=True)
class AxisRoles:
    """Mesh axis -> (its role in the attention layout, its role in the MoE layout).

    Axes missing from ``roles`` play the role of their own name in both layouts.
    """

    roles: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for axis, pair in self.roles.items():
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(
                    f"AxisRoles.roles[{axis!r}]={pair!r}: give (attention role, MoE role)"
                )

    def group_name(self, axes: tuple[str, ...], moe: bool) -> str:
        """The group's name: its axes' roles in one layout, outermost first."""
        roles: list[str] = []
        for axis in axes:
            role = self.roles.get(axis, (axis, axis))[1 if moe else 0]
            if role not in roles:
                roles.append(role)
        return "+".join(ROLE_NAMES.get(role, role) for role in roles)


def collective_axes(op: Op) -> tuple[str, ...]:
    """The mesh axes of a collective, as a tuple (a single name becomes a 1-tuple)."""
    params = op.eqn.params
    axes = params.get("axes", params.get("axis_name", ()))
    axes = axes if isinstance(axes, tuple | list) else (axes,)
    return tuple(axis for axis in axes if isinstance(axis, str))


def _exchange_order(program: Program) -> dict[Op, bool]:
    """For each all-to-all: whether it reads what an all-to-all of the same layer and
    phase sent (a second exchange: the combine in the forward pass)."""
    upstream: dict[Value, frozenset[tuple[str, Phase]]] = {}
    second: dict[Op, bool] = {}
    for op in program.ops:
        seen = frozenset().union(*(upstream.get(a, frozenset()) for a in op.inputs))
        if op.primitive == "all_to_all":
            key = (op.layer, op.phase)
            second[op] = key in seen
            seen = seen | {key}
        if seen:
            upstream.update(dict.fromkeys(op.outputs, seen))
    return second


def _along_sequence(op: Op) -> bool:
    params = op.eqn.params
    dimension = params.get("all_gather_dimension", params.get("scatter_dimension"))
    rank = len(getattr(op.inputs[0].aval, "shape", ()))
    return dimension is not None and dimension != rank - 1


def collective_purposes(program: Program, roles: AxisRoles | None = None) -> dict[Op, str]:
    """A short purpose for every collective of ``program``, e.g. ``tensor all_gather
    (sequence)``, ``expert all_to_all (dispatch)``, ``gradient psum``."""
    roles = AxisRoles() if roles is None else roles
    exchange_second = _exchange_order(program)
    purposes: dict[Op, str] = {}
    for op in program.collectives():
        scopes = op.layer.split("/")
        kind = op.primitive
        task = next((TASK_SCOPES[s] for s in scopes if s in TASK_SCOPES), None)
        if task is not None:
            purposes[op] = f"{task} {kind}"
            continue
        moe = any(s in MOE_SCOPES for s in scopes)
        dense = not moe and any(s in DENSE_SCOPES for s in scopes)
        group = roles.group_name(collective_axes(op), moe)
        detail = ""
        if kind == "all_to_all" and moe:
            combine = exchange_second.get(op, False) != (op.phase is Phase.BACKWARD)
            detail = " (combine)" if combine else " (dispatch)"
        elif group == "context" and dense and kind == "ppermute":
            detail = " (ring)"
        elif group == "context" and dense and kind == "all_gather":
            detail = " (keys and values)"
        elif kind in ("all_gather", "reduce_scatter") and dense and _along_sequence(op):
            detail = " (sequence)"
        purposes[op] = f"{group} {kind}{detail}"
    return purposes
