"""An analytic cost model: seconds per op from FLOPs and bytes over a device profile.

Compute: ``overhead + max(flops / (peak_flops x efficiency), bytes / memory_bandwidth)``,
a roofline with a fixed cost per kernel (launch, dispatch). Matmuls run at the
profile's matmul efficiency (:meth:`~scheduling.profiles.DeviceProfile.matmul_fraction`, a
measured curve over the product's FLOPs), other ops at the peak. Layout-only ops
(reshape, squeeze, ...) and identities (:func:`~scheduling.costs.fusion.is_identity`; in a
bound program, sums with zeros too) cost nothing: XLA makes them views, fuses or drops
them. A slice or gather reads the part it takes; an update in place
(``dynamic_update_slice``, scatters) reads its update and writes the region it updates,
not its whole buffer.

Fusion (:mod:`scheduling.costs.fusion`, the rule the memory walk reads too): on a profile
with ``fused_elementwise``, a cost model bound to a program (:meth:`CostModel.bound_to`)
prices kernels, not ops: an op whose values XLA fuses into their readers costs its FLOPs
alone (no bytes, no launch); a kernel's last op reads the buffers under its fused
operands and writes its own. With ``fused_kernels``, the ops of a one-kernel scope (an
attention core, which cuDNN runs as one kernel) read and write only what crosses the
scope. Ops the bound program does not hold (copies a pass made later) are priced alone.
Collectives: ``latency + bytes_on_the_wire / link_bandwidth`` with the usual
algorithmic factors over a group of ``n`` devices (all-to-all and gathers move
``(n - 1) / n`` of the buffer, a ring all-reduce twice that).

Ragged exchanges (dropless MoE layers that move only their routed rows) are priced by
the rows they carry, not by their buffers: ``jax.lax.ragged_all_to_all`` by the smaller of
its operand's and its output's rows (the sender's routed rows, or the returned ones), and
every op under a name scope ``ragged_rows_N`` (:data:`RAGGED_SCOPE`; the model puts its
ragged exchanges and grouped GEMMs there, ``N`` the rows they carry under even routing)
as carrying ``N`` rows: an ``all_to_all`` of pieces ``[G, rows, ...]`` (the static form
of a ragged exchange, where XLA cannot run one) moves ``N`` of its ``G x rows`` rows, a
grouped GEMM (``ragged_dot_general``) multiplies ``N`` of its buffer's rows. Where routing
is uneven the busiest device receives more than ``N``: ``CostModel(ragged_load=)`` is that
max/mean, from routing statistics (1: even routing).

A copy of a bound program's op run on a chunk of the batch, priced before the program
that holds it exists (the forward partition's search), is fused as the op it copies is
(:meth:`CostModel.chunk_seconds`).

Control flow is priced by what it runs: a ``scan`` as its body's ops ``length`` times
(a blockwise attention's loop over tiles), a ``cond`` as its costliest branch, a
``while`` as one trip (its trip count is known only when the step runs).

Fused attention (cuDNN's flash attention, ``dot_product_attention_fwd`` and ``_bwd``
custom calls) is priced by its matmuls: ``4 x batch x heads x q x k x head_dim`` FLOPs
forward, 2.5 times that backward (five products to two), halved under a causal mask, and
its operands and results in bytes.

The device figures come from a :class:`~scheduling.profiles.DeviceProfile`.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from typing import Any

from scheduling.costs.collective_groups import GroupSpread, group_members, group_spread
from scheduling.costs.fusion import (
    FUSIBLE,
    IN_PLACE,
    SLICING,
    Fusion,
    in_place_bytes,
    is_identity,
    kernel_scope,
)
from scheduling.costs.link_model import CollectiveCurves
from scheduling.profiles import DeviceProfile
from scheduling.program import jax_adapter
from scheduling.program.capture import Op, aval_bytes
from scheduling.program.collective_purpose import collective_axes
from scheduling.program.program_memo import ProgramMemo

# Ops that only relabel or view memory.
FREE_PRIMITIVES = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "stop_gradient",
        "copy_p",
        "pvary",
        "optimization_barrier",
    }
)
# Elementwise ops that cost several FLOPs per element.
TRANSCENDENTAL = frozenset(
    {"exp", "exp2", "log", "log1p", "log2", "tanh", "logistic", "erf", "erf_inv", "sin",
     "cos", "pow"}
)  # fmt: skip
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", "cumsum"})
# The name scope of ops that carry ragged rows; the number is their rows under even routing.
RAGGED_SCOPE = re.compile(r"ragged_rows_(\d+)")


def _size(aval: Any) -> int:
    return math.prod(getattr(aval, "shape", ()))


def ragged_rows(op: Op) -> int | None:
    """The rows ``op`` carries by its ``ragged_rows_N`` scope (the innermost), or None."""
    found = RAGGED_SCOPE.findall(op.name_stack)
    return int(found[-1]) if found else None


def _ragged_dot_flops(op: Op) -> float:
    """A grouped GEMM: ``2 x lhs elements x the rhs's free dimensions`` (every lhs row meets
    one group's matrix), over the rows of its ``ragged_rows`` scope where it has one."""
    numbers = op.eqn.params["ragged_dot_dimension_numbers"]
    (_, rhs_contract), (_, rhs_batch) = numbers.dot_dimension_numbers
    lhs_shape, rhs_shape = op.inputs[0].aval.shape, op.inputs[1].aval.shape
    bound = set(rhs_contract) | set(rhs_batch) | set(numbers.rhs_group_dimensions)
    free = math.prod(size for d, size in enumerate(rhs_shape) if d not in bound)
    flops = 2.0 * math.prod(lhs_shape) * free
    rows, (ragged,) = ragged_rows(op), numbers.lhs_ragged_dimensions
    if rows is not None and lhs_shape[ragged]:
        flops *= min(1.0, rows / lhs_shape[ragged])
    return flops


def body_ops(op: Op) -> list[tuple[Any, list[Op], float]]:
    """Each sub-program of a control-flow op (:func:`scheduling.program.jax_adapter.subprograms`):
    its jaxpr, its ops (under the op's name stack) and how often it runs; empty for any
    other op."""
    return [
        (
            jaxpr,
            [
                Op(-1, eqn, tuple(eqn.invars), tuple(eqn.outvars), op.name_stack, op.phase)
                for eqn in jaxpr.eqns
            ],
            repeats,
        )
        for jaxpr, repeats in jax_adapter.subprograms(op.eqn)
    ]


def _over_bodies(op: Op, price) -> float:
    """``price`` summed over a control-flow op's sub-programs: a scan's body times its
    length, the costliest branch of a cond, a while's condition and body once."""
    bodies = [repeats * sum(price(inner) for inner in ops) for _, ops, repeats in body_ops(op)]
    if op.primitive == "cond":
        return max(bodies, default=0.0)
    return sum(bodies)


# cuDNN's fused attention: its forward and backward custom calls.
FUSED_ATTENTION = re.compile(r"dot_product_attention_(fwd|bwd)")


def _fused_attention_flops(op: Op) -> float:
    """cuDNN flash attention: the products ``q k^T`` and ``p v`` forward, five products
    backward (2.5 times), over the visible half of the scores under a causal mask.
    Operands ``[batch, q, heads, d]``, keys and values ``[batch, k, kv_heads, d]``."""
    query, key, value = (a.aval.shape for a in op.inputs[:3])
    batch, length, heads, head_dim = query
    keys = key[1]
    flops = 2.0 * batch * heads * length * keys * (head_dim + value[-1])
    if "CAUSAL" in str(op.eqn.params.get("mask_type", "")):
        flops /= 2
    window = op.eqn.params.get("sliding_window_length")
    if window:
        flops *= min(1.0, window / keys)
    return flops * (2.5 if FUSED_ATTENTION.search(op.primitive).group(1) == "bwd" else 1.0)


# Ops priced at the profile's matmul efficiency.
MATMULS = frozenset({"dot_general", "ragged_dot_general"})


def is_matmul(op: Op) -> bool:
    return op.primitive in MATMULS or bool(FUSED_ATTENTION.search(op.primitive))


def op_flops(op: Op) -> float:
    """Floating-point operations of one (non-collective) op."""
    name = op.primitive
    if jax_adapter.subprograms(op.eqn):
        return _over_bodies(op, op_flops)
    if FUSED_ATTENTION.search(name):
        return _fused_attention_flops(op)
    if name == "ragged_dot_general":
        return _ragged_dot_flops(op)
    if name == "dot_general":
        (lhs_contract, _), _ = op.eqn.params["dimension_numbers"]
        lhs_shape = op.inputs[0].aval.shape
        contracted = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2.0 * sum(_size(v.aval) for v in op.outputs) * contracted
    if _free(op):
        return 0.0
    if name in REDUCTIONS:
        return float(sum(_size(a.aval) for a in op.inputs))
    elements = float(sum(_size(v.aval) for v in op.outputs))
    return elements * (8.0 if name in TRANSCENDENTAL else 1.0)


def _free(op: Op) -> bool:
    """Whether ``op`` costs nothing: a view or an identity XLA drops."""
    return op.primitive in FREE_PRIMITIVES or is_identity(op)


def op_bytes(op: Op) -> float:
    """Bytes an op reads and writes."""
    if _free(op):
        return 0
    if jax_adapter.subprograms(op.eqn):
        return _over_bodies(op, op_bytes)
    rest = sum(aval_bytes(a.aval) for a in op.inputs[1:] if a.aval.shape)  # scalars: arguments
    if op.primitive in SLICING:  # reads the part it takes, writes it
        return 2 * sum(aval_bytes(v.aval) for v in op.outputs) + rest
    if op.primitive in IN_PLACE:  # reads the update, writes it in place
        return in_place_bytes(op, rest)
    return sum(aval_bytes(a.aval) for a in op.inputs) + sum(aval_bytes(v.aval) for v in op.outputs)


def _own_bytes(op: Op) -> float:
    """Bytes of an op's own operands and results (a control-flow op's, not its bodies')."""
    return float(sum(aval_bytes(a.aval) for a in (*op.inputs, *op.outputs)))


def _index_groups(op: Op) -> tuple[tuple[int, ...], ...] | None:
    """The op's ``axis_index_groups`` (subgroups of the devices along its axes), if any."""
    return op.eqn.params.get("axis_index_groups")


def _group_size(op: Op, axis_sizes: dict[str, int]) -> int:
    groups = _index_groups(op)
    if groups:
        return len(groups[0])
    return math.prod(axis_sizes.get(axis, 1) for axis in collective_axes(op))


def is_ragged_exchange(op: Op) -> bool:
    """A ragged all-to-all: ``ragged_all_to_all``, or an ``all_to_all`` under a
    ``ragged_rows`` scope (its static form)."""
    return op.primitive == "ragged_all_to_all" or (
        op.primitive == "all_to_all" and ragged_rows(op) is not None
    )


def _routed_bytes(op: Op) -> float | None:
    """The bytes of the rows a ragged exchange carries (None for any other op)."""
    if op.primitive == "ragged_all_to_all":
        operand, output = op.inputs[0].aval, op.inputs[1].aval
        rows = min(operand.shape[0], output.shape[0])
        row_bytes = aval_bytes(operand) / max(1, operand.shape[0])
    elif op.primitive == "all_to_all" and ragged_rows(op) is not None:
        operand = op.inputs[0].aval
        if len(operand.shape) < 2 or op.eqn.params["split_axis"] != 0:
            return None  # not the pieces [G, rows, ...] of a ragged exchange
        rows = operand.shape[0] * operand.shape[1]
        row_bytes = aval_bytes(operand) / max(1, rows)
    else:
        return None
    scoped = ragged_rows(op)
    if scoped is not None:
        rows = min(rows, scoped)
    return rows * row_bytes


def _operand_bytes(op: Op, ragged_load: float = 1.0) -> float:
    """The operand bytes a collective is priced by: a ragged exchange's routed rows (on its
    busiest device, ``ragged_load`` times the mean), else its operands."""
    routed = _routed_bytes(op)
    if routed is not None:  # never more than its largest buffer
        static = max(aval_bytes(op.inputs[0].aval), aval_bytes(op.outputs[0].aval))
        return min(static, routed * ragged_load)
    return sum(aval_bytes(a.aval) for a in op.inputs)


def collective_wire_bytes(op: Op, axis_sizes: dict[str, int], ragged_load: float = 1.0) -> float:
    """Bytes each device sends for one collective (a ragged exchange: its routed rows)."""
    n = _group_size(op, axis_sizes)
    if n <= 1:
        return 0.0
    operand = _operand_bytes(op, ragged_load)
    result = sum(aval_bytes(v.aval) for v in op.outputs)
    share = (n - 1) / n
    return {
        "all_to_all": operand * share,
        "ragged_all_to_all": operand * share,
        "all_gather": result * share,
        "reduce_scatter": operand * share,
        "psum": 2 * operand * share,
        "psum_invariant": 2 * operand * share,
        "pmax": 2 * operand * share,
        "pmin": 2 * operand * share,
        "ppermute": operand,
    }.get(op.primitive, operand)


# The fusions of the programs priced last: a plan prices each traced program under every
# schedule it estimates, and a bound model is made for each.
_FUSIONS: ProgramMemo[Fusion] = ProgramMemo(kept=4)


class CostModel:
    """Estimated seconds of ops and collectives on one device profile.

    With ``curves`` (measured, see ``scheduling.costs.link_model``), a collective whose kind
    and group size they cover costs what its curve gives for its operand bytes.
    ``device_ids`` are the mesh's device ids in mesh order (row-major over
    ``axis_sizes``; default: the ids in that order): on a profile with nodes they say
    which members of each group (over any tuple of axes) share a node. ``ragged_load``:
    the expected max/mean of the rows the devices receive in a ragged exchange (routing
    statistics; 1 for even routing), see the module docstring.
    """

    def __init__(
        self,
        profile: DeviceProfile,
        axis_sizes: dict[str, int],
        curves: CollectiveCurves | None = None,
        device_ids: Sequence[int] | None = None,
        ragged_load: float = 1.0,
    ):
        if ragged_load < 1.0:
            raise ValueError(f"ragged_load={ragged_load}: a max/mean load is at least 1")
        self.ragged_load = float(ragged_load)
        self.profile = profile
        self.axis_sizes = dict(axis_sizes)
        self.curves = curves
        self.device_ids = None if device_ids is None else tuple(device_ids)
        self._spreads: dict[tuple, GroupSpread] = {}
        self.fusion: Fusion | None = None  # of the program it is bound to
        self._program: Any = None
        self._bodies: dict[int, tuple[Any, list[tuple[list[Op], float, Fusion | None]]]] = {}
        self._priced: dict[Op, float] | None = None  # each op's seconds: priced_once

    def bound_to(self, program: Any) -> CostModel:
        """This model pricing the kernels of ``program`` (a captured
        :class:`~scheduling.program.capture.Program`; see the module docstring); itself
        where its profile does not fuse, or it is bound to ``program`` already."""
        if not self.profile.fused_elementwise or self._program is program:
            return self
        bound = copy.copy(self)
        kernels = self.profile.fused_kernels
        bound.fusion = _FUSIONS.get(
            program, kernels, lambda: Fusion(program.ops, program.outputs, kernels)
        )
        bound._program = program
        bound._bodies = {}
        bound._priced = None if self._priced is None else {}
        return bound

    def rebound(self, program: Any) -> CostModel:
        """This model pricing ``program``, made from the program it is bound to (that one
        partitioned, say: its kernels are its own); itself where it is bound to none."""
        return self if self._program is None else self.bound_to(program)

    def priced_once(self) -> CostModel:
        """This model remembering each op's seconds once priced, for a caller that asks
        for the same ops many times and then lets the model go (the planner prices one
        program under every schedule, each search weighing many candidates). The memo
        keeps every op it priced alive: not for a model a compiled step holds."""
        model = copy.copy(self)
        model._priced = {}
        return model

    def spread(self, op: Op) -> GroupSpread:
        """How the groups of collective ``op`` lie over the profile's nodes."""
        key = (collective_axes(op), _index_groups(op))
        if key not in self._spreads:
            self._spreads[key] = group_spread(
                key[0], self.axis_sizes, self.profile.devices_per_node, self.device_ids, key[1]
            )
        return self._spreads[key]

    def compute_seconds(self, op: Op) -> float:
        if _free(op):
            return 0.0
        fusion = self.fusion if self.fusion is not None and self.fusion.knows(op) else None
        if fusion is not None and fusion.drops(op):
            return 0.0
        if jax_adapter.subprograms(op.eqn):
            return self._control_flow_seconds(op, fusion)
        return self._kernel_seconds(op, fusion)

    def arithmetic_seconds(self, op: Op) -> float:
        """Seconds of ``op``'s FLOPs alone: at the profile's peak for its operands' dtype,
        times its matmul efficiency where it is a matmul."""
        flops = op_flops(op)
        if not flops:
            return 0.0
        operand = op.inputs[0] if op.inputs else op.outputs[0]
        peak = self.profile.peak_flops_per_s(operand.aval.dtype)
        if is_matmul(op):
            peak *= self.profile.matmul_fraction(flops)
        return flops / peak

    def launches(self, op: Op) -> bool:
        """Whether ``op`` pays a kernel's launch: it writes a buffer of its own (on a fusing
        profile, an op XLA fuses into its readers does not)."""
        if _free(op) or op.is_collective:
            return False
        if self.fusion is not None and self.fusion.knows(op):
            return self.fusion.launches(op)
        return not (self.profile.fused_elementwise and op.primitive in FUSIBLE)

    def bytes_moved(self, op: Op) -> float:
        """Bytes ``op`` reads and writes in memory as this model prices it (a control-flow
        op: its bodies' ops, times how often each runs; in a one-kernel scope on a profile
        with ``fused_kernels``, its own operands and results)."""
        if _free(op):
            return 0.0
        fusion = self.fusion if self.fusion is not None and self.fusion.knows(op) else None
        if not jax_adapter.subprograms(op.eqn):
            return op_bytes(op) if fusion is None else fusion.bytes(op)
        if fusion is not None and self.profile.fused_kernels and kernel_scope(op.name_stack):
            return fusion.bytes(op)
        bodies = [
            repeats * sum(model.bytes_moved(inner) for inner in ops)
            for ops, repeats, model in self.bodies(op)
        ]
        return max(bodies, default=0.0) if op.primitive == "cond" else sum(bodies)

    def _kernel_seconds(self, op: Op, fusion: Fusion | None) -> float:
        moved = op_bytes(op) if fusion is None else fusion.bytes(op)
        return self._kernel(self.arithmetic_seconds(op), moved, self.launches(op))

    def _kernel(self, arithmetic: float, moved: float, launches: bool) -> float:
        """One kernel's seconds: the roofline of its arithmetic and the bytes it moves, and
        the profile's launch cost where it launches."""
        roofline = max(arithmetic, moved / self.profile.memory_bytes_per_s)
        return roofline + (self.profile.op_overhead_s if launches else 0.0)

    def _control_flow_seconds(self, op: Op, fusion: Fusion | None) -> float:
        """A control-flow op: in a one-kernel scope on a profile with ``fused_kernels``,
        one kernel (its bodies' arithmetic; its own operands and results moved once); else
        each body op priced as a kernel of its body, times how often the body runs."""
        if fusion is not None and self.profile.fused_kernels and kernel_scope(op.name_stack):
            arithmetic = _over_bodies(op, self.arithmetic_seconds)
            return self._kernel(arithmetic, fusion.bytes(op), fusion.launches(op))
        bodies = [
            repeats * sum(model.seconds(inner) for inner in ops)
            for ops, repeats, model in self.bodies(op)
        ]
        if op.primitive == "cond":
            return max(bodies, default=0.0)
        return sum(bodies)

    def bodies(self, op: Op) -> list[tuple[list[Op], float, CostModel]]:
        """Each sub-program of control-flow op ``op``: its ops, how often it runs, and this
        model pricing them (on a fusing profile, bound to the body's kernels)."""
        return [
            (ops, repeats, self if fusion is None else self._with_fusion(fusion))
            for ops, repeats, fusion in self._bodies_of(op)
        ]

    def _bodies_of(self, op: Op) -> list[tuple[list[Op], float, Fusion | None]]:
        """The sub-programs of ``op`` (its ops, repeats and, on a fusing profile, their
        fusion), made once per sub-program."""
        key = id(op.eqn)
        if key not in self._bodies:
            bodies = []
            for jaxpr, ops, repeats in body_ops(op):
                fused = None
                if self.profile.fused_elementwise:
                    fused = Fusion(ops, jaxpr.outvars, self.profile.fused_kernels)
                bodies.append((ops, repeats, fused))
            self._bodies[key] = (op.eqn, bodies)  # the equation kept: its id stays its own
        return self._bodies[key][1]

    def _with_fusion(self, fusion: Fusion) -> CostModel:
        model = copy.copy(self)
        model.fusion = fusion
        model._priced = None if self._priced is None else {}
        return model

    def collective_seconds(self, op: Op) -> float:
        wire = collective_wire_bytes(op, self.axis_sizes, self.ragged_load)
        if wire == 0:
            return 0.0
        group = _group_size(op, self.axis_sizes)
        if self.curves is not None:
            operand = _operand_bytes(op, self.ragged_load)
            kind = "all_to_all" if op.primitive == "ragged_all_to_all" else op.primitive
            measured = self.curves.seconds(kind, group, operand)
            if measured is not None:
                return measured
        profile = self.profile
        if profile.devices_per_node and op.primitive == "ppermute":
            return self._permutation(op)
        if profile.devices_per_node:
            spread = self.spread(op)
            if spread.nodes > 1:
                return self._across_nodes(op, spread)
        return profile.link_latency_s + wire / profile.link_bytes_per_s

    def _permutation(self, op: Op) -> float:
        """A ``ppermute`` on a profile with nodes: pairs inside a node use the device link;
        the pairs that leave (or enter) a node share its node link, with those of the
        other groups on the node (every device runs the collective, each in its group)."""
        profile = self.profile
        operand = sum(aval_bytes(a.aval) for a in op.inputs)
        members = group_members(collective_axes(op), self.axis_sizes)
        ids = self.device_ids or range(math.prod(self.axis_sizes.values()))
        node = [ids[member] // profile.devices_per_node for member in members]
        crossing: dict[tuple[str, int], int] = {}
        inside = False
        for source, target in op.eqn.params["perm"]:
            if node[source] == node[target]:
                inside = inside or source != target
                continue
            for key in (("out", node[source]), ("in", node[target])):
                crossing[key] = crossing.get(key, 0) + 1
        seconds = operand / profile.link_bytes_per_s if inside else 0.0
        latency = profile.link_latency_s
        if crossing:
            latency += profile.node_link_latency_s
            sharing = max(1, self.spread(op).groups_sharing_a_node)
            busiest = max(crossing.values()) * sharing * operand
            seconds = max(seconds, busiest / profile.node_link_bytes_per_s)
        return latency + seconds

    def _across_nodes(self, op: Op, spread: GroupSpread) -> float:
        """A collective whose groups span ``spread.nodes`` nodes, ``spread.local`` members
        on a node at most.

        All-to-all: the in-node share goes over each device's link while the rest crosses
        the node link, shared by every member on the node (of every group), at the same
        time. Reductions and gathers run hierarchically: within the node, then across
        nodes, where the groups with members on the node (every device runs the
        collective) share its link.
        """
        profile = self.profile
        group, local, nodes = spread.size, spread.local, spread.nodes
        operand = _operand_bytes(op, self.ragged_load)
        result = sum(aval_bytes(v.aval) for v in op.outputs)
        latency = profile.link_latency_s + profile.node_link_latency_s
        if op.primitive in ("all_to_all", "ragged_all_to_all"):
            inside = operand * (local - 1) / group / profile.link_bytes_per_s
            across = spread.all_to_all_node_load * operand / profile.node_link_bytes_per_s
            return latency + max(inside, across)
        if op.primitive in ("psum", "psum_invariant", "pmax", "pmin"):
            volume, passes = operand, 2
        elif op.primitive == "all_gather":
            volume, passes = result, 1
        elif op.primitive == "reduce_scatter":
            volume, passes = operand, 1
        else:  # ppermute and the rest: the whole operand over the node link
            return latency + operand / profile.node_link_bytes_per_s
        inside = passes * volume * (local - 1) / local / profile.link_bytes_per_s
        across = passes * volume * (nodes - 1) / nodes / profile.node_link_bytes_per_s
        return latency + inside + across * max(1, spread.groups_sharing_a_node)

    def seconds(self, op: Op) -> float:
        """Seconds of ``op`` (a collective on the link, anything else as computation),
        looked up once priced where the model is :meth:`priced_once`."""
        if self._priced is None:
            return self._seconds(op)
        found = self._priced.get(op)
        if found is None:
            found = self._priced[op] = self._seconds(op)
        return found

    def chunk_seconds(self, original: Op, copy: Op) -> float:
        """Seconds of ``copy``, an op of the bound program run on a chunk of the batch, as
        a fusing compiler would run it where it runs ``original`` so: fused where that is
        fused, one kernel where that is, its memory traffic the original's scaled by how
        much less the copy reads and writes (a chunk reads a weight whole, and its rows
        in part). The search prices a range partitioned before that program exists."""
        fusion = self.fusion
        if fusion is None or not fusion.knows(original) or original.is_collective:
            return self.seconds(copy)
        if original.primitive in FREE_PRIMITIVES:
            return 0.0
        whole, part = _own_bytes(original), _own_bytes(copy)
        moved = fusion.bytes(original) * (part / whole if whole else 1.0)
        if jax_adapter.subprograms(original.eqn):
            if not (self.profile.fused_kernels and kernel_scope(original.name_stack)):
                return self.seconds(copy)  # its bodies' ops, priced as kernels of the body
            arithmetic = _over_bodies(copy, self.arithmetic_seconds)
        else:
            arithmetic = self.arithmetic_seconds(copy)
        return self._kernel(arithmetic, moved, fusion.launches(original))

    def _seconds(self, op: Op) -> float:
        if op.is_collective or op.primitive == "ragged_all_to_all":
            return self.collective_seconds(op)
        return self.compute_seconds(op)
