"""Ragged dropless dispatch: only the routed rows move, and the experts are one grouped GEMM.

The padded dropless dispatch gives every expert ``group_size`` slots per routing group, so
its buffers, exchanges and expert GEMMs are ``num_experts / top_k`` times the routed rows.
Here (``moe.dropless_dispatch ragged``), as in Megatron-Core's dropless path and MaxText's
ragged ``all_to_all``, each device, with ``T`` tokens, top-``k`` routing, ``G`` devices in
its expert group and ``S`` expert slots per device (its experts, and its replica slots):

1. gives every assignment its expert slot (its expert; with replicas one of its copies,
   :mod:`jaxmoe.layers.replicated`) and sorts its ``T x k`` assignments by slot: by
   destination device, and within it by local slot;
2. exchanges the counts first: one ``all_gather`` of each device's rows per slot
   (``[G, G x S]`` integers; with the balanced split, of its rows per expert, from which
   every device derives the same) tells every device where every slice lands. A receiver's
   buffer is slot-major (slot 0's rows from source 0, 1, ..., then slot 1's), so its
   slots arrive as the contiguous groups of a grouped GEMM;
3. exchanges exactly the routed rows (:func:`ragged_all_to_all`), applies the experts as
   one grouped GEMM (:meth:`~jaxmoe.layers.experts.Experts.grouped`, ``ragged_dot``) and
   sends the outputs back by the transposed exchange, to the sorted positions they left;
4. unsorts them and sums each token's outputs by its combine weights.

The receive buffer. A shape must be static, so the buffer is bounded: ``B = min(worst,
ceil(moe.ragged_buffer_factor x T x k))`` rows (:func:`receive_bound`), ``T x k`` being
what a device receives under even routing and ``worst = G x T x min(k, S)`` the most it
can receive (every token of the expert group sending it one row per chosen expert it
holds). The default (factor None) is the worst case, which no step can exceed: shapes never
change and nothing ever drops. With a factor, a step whose rows for a device exceed ``B``
drops the rows past it, in the buffer's order (the device's last slots; within a slot, the
last sources), and the layer counts them as dropped assignments, as capacity mode does.

What lowers to what. Where XLA runs ``ragged_all_to_all`` (GPU, TPU), the exchange is
``jax.lax.ragged_all_to_all``: the routed rows move, nothing else. XLA:CPU compiles it but
refuses to run it (jax 0.10.2, the version pinned here, and 0.12.0.1 alike), so on CPU the
exchange is :func:`emulated_ragged_all_to_all`, the same result from static collectives:
each peer's slices packed into a piece of ``max_rows_per_peer`` rows (zeros after the
routed ones), one ``all_to_all`` of the pieces, and a scatter of the received rows to
their offsets. That ``all_to_all`` moves the bound, not the routed rows: ``G x b`` rows
per device, ``b = min(T x min(k, S), B)``, as many as the padded dispatch when a device
holds one expert.
The scheduler's socket transport (the emulated cluster) sends each piece of such an
exchange only up to its last non-zero row, so there only the routed rows cross the wire.
``ragged_dot`` lowers to a grouped GEMM on GPU and TPU; on CPU, JAX lowers it to a masked
dense matmul per group (``S`` times the buffer's rows of work).

The contract with the scheduler. The pieces' ``all_to_all`` (or the native
``ragged_all_to_all``) and the grouped GEMMs run under the name scope
``ragged_rows_N`` (:data:`RAGGED_SCOPE`), ``N`` the rows they carry under even routing
(``T x k``): the cost model prices them by those rows, the socket transport sends the
pieces' rows up to the last non-zero one, and COMET leaves such exchanges whole.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxmoe.config.layout import EXPERT, EXPERT_TENSOR
from jaxmoe.layers.dispatch import DispatchStats
from jaxmoe.layers.experts import Experts
from jaxmoe.layers.router import RouterOutput
from jaxmoe.layers.routing_groups import RoutingGroups
from jaxmoe.parallel.mesh import role_axes, role_size

# Name scope of the ops that carry ragged rows: N is their row count under even routing.
RAGGED_SCOPE = "ragged_rows_{}"


def native_exchange_runs() -> bool:
    """Whether XLA runs ``ragged_all_to_all`` on the default backend (not on CPU)."""
    return jax.default_backend() != "cpu"


def receive_bound(tokens: int, top_k: int, group: int, slots: int, factor: float | None) -> int:
    """Rows of a device's receive buffer: ``factor x tokens x top_k`` (rounded up), never
    more than the worst case ``group x tokens x min(top_k, slots)``; None: the worst case."""
    worst = group * tokens * min(top_k, slots)
    if factor is None:
        return worst
    return max(1, min(worst, math.ceil(factor * tokens * top_k)))


@contextlib.contextmanager
def ragged_scope(rows: int | None) -> Iterator[None]:
    """The scope that tells the scheduler an op carries ``rows`` ragged rows (None: no scope)."""
    if rows is None:
        yield
        return
    with jax.named_scope(RAGGED_SCOPE.format(rows)):
        yield


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _piece_rows(sizes: jax.Array, offsets: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """For pieces that hold slices back to back (``sizes [G, n]``), the row each piece row
    ``q < rows`` stands for, ``offsets[g, j] + q - start of slice j``, and whether it holds
    one: ``([G, rows], [G, rows])``."""
    per_peer = sizes.shape[1]
    starts = _exclusive_cumsum(sizes, 1)
    q = jnp.arange(rows, dtype=sizes.dtype)
    slice_of = jnp.sum(starts[:, None, :] + sizes[:, None, :] <= q[None, :, None], axis=-1)
    valid = slice_of < per_peer
    slice_of = jnp.minimum(slice_of, per_peer - 1)
    row = (
        jnp.take_along_axis(offsets, slice_of, axis=1)
        + q[None, :]
        - jnp.take_along_axis(starts, slice_of, axis=1)
    )
    return row, valid


def emulated_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: Any,
    max_rows_per_peer: int,
    received_output_offsets: jax.Array | None = None,
    expected_rows: int | None = None,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` from static collectives (for XLA:CPU): the same result.

    Slice ``i`` (of ``K = G x n``) goes to device ``i // n``, as there. Each peer's slices
    are packed back to back into a piece of ``max_rows_per_peer`` rows (which must hold the
    sum of the sizes sent to any one peer; zeros after them), the pieces are exchanged by one
    ``all_to_all`` (under :func:`ragged_scope` of ``expected_rows``), and each received
    slice is written at its offset in ``output``. ``received_output_offsets``: the
    ``all_to_all`` of ``output_offsets`` (where each received slice goes), when the caller
    knows it; else it is exchanged too. Differentiable: the transpose is the exchange back.
    """
    chex.assert_rank([input_offsets, send_sizes, output_offsets, recv_sizes], 1)
    group = jax.lax.axis_size(axis_name)
    slices = input_offsets.shape[0]
    if slices % group:
        raise ValueError(f"{slices} slices do not divide over the {group} devices of the group")
    per_peer = slices // group
    rows = max_rows_per_peer
    source, valid = _piece_rows(
        send_sizes.reshape(group, per_peer), input_offsets.reshape(group, per_peer), rows
    )
    source = jnp.where(valid, source, operand.shape[0])  # past the end: a zero row
    pieces = jnp.take(operand, source, axis=0, mode="fill", fill_value=0)  # [G, rows, ...]
    with ragged_scope(expected_rows):
        received = jax.lax.all_to_all(pieces, axis_name, 0, 0)
    if received_output_offsets is None:
        received_output_offsets = jax.lax.all_to_all(
            output_offsets.reshape(group, per_peer), axis_name, 0, 0
        )
    target, valid = _piece_rows(
        recv_sizes.reshape(group, per_peer), received_output_offsets.reshape(group, per_peer), rows
    )
    target = jnp.where(valid, target, output.shape[0]).reshape(-1)  # past the end: dropped
    received = received.reshape(group * rows, *operand.shape[1:])
    written = jnp.zeros(output.shape[:1], bool).at[target].set(True, mode="drop")
    scattered = jnp.zeros_like(output).at[target].add(received.astype(output.dtype), mode="drop")
    written = written.reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(written, scattered, output)


def ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: Any,
    max_rows_per_peer: int,
    received_output_offsets: jax.Array | None = None,
    expected_rows: int | None = None,
    native: bool | None = None,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` where the backend runs it (``native``; default: not on
    CPU), else :func:`emulated_ragged_all_to_all`; the arguments of both."""
    if native is None:
        native = native_exchange_runs()
    if native:
        with ragged_scope(expected_rows):
            return jax.lax.ragged_all_to_all(
                operand,
                output,
                input_offsets,
                send_sizes,
                output_offsets,
                recv_sizes,
                axis_name=axis_name,
            )
    return emulated_ragged_all_to_all(
        operand,
        output,
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis_name,
        max_rows_per_peer=max_rows_per_peer,
        received_output_offsets=received_output_offsets,
        expected_rows=expected_rows,
    )


class RaggedPlan(NamedTuple):
    """The expert slot of each of this device's assignments: no capacity drops one (rows
    past a receive buffer drop in the exchange)."""

    slot: jax.Array  # [T, k]: global slots of the expert group, device i holding [i S, (i+1) S)
    weight: jax.Array  # [T, k]: the combine weights
    num_slots: int
    replica_table: jax.Array | None = None
    # [G, num_slots]: the rows every source sends to every slot, where the plan knows them
    # (:func:`~jaxmoe.placement.copy_split.balanced_slots`); else the exchange gathers them.
    slot_counts: jax.Array | None = None


class _Exchange(NamedTuple):
    """The arguments of one :func:`ragged_all_to_all` of the expert group."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array
    received_output_offsets: jax.Array
    axes: tuple[str, ...]
    peer_rows: int
    expected_rows: int

    def move(self, operand: jax.Array, rows: int) -> jax.Array:
        """``operand``'s slices exchanged into a buffer of ``rows`` rows (zeros elsewhere)."""
        return ragged_all_to_all(
            operand,
            jnp.zeros((rows, operand.shape[-1]), operand.dtype),
            self.input_offsets,
            self.send_sizes,
            self.output_offsets,
            self.recv_sizes,
            received_output_offsets=self.received_output_offsets,
            axis_name=self.axes,
            max_rows_per_peer=self.peer_rows,
            expected_rows=self.expected_rows,
        )


class RaggedSent(NamedTuple):
    rows: jax.Array  # [buffer rows, d]: the received rows, slot-major
    group_sizes: jax.Array  # [local slots]: the rows of each slot, in order
    kept: jax.Array  # [num_slots]: this device's rows kept per global slot
    order: jax.Array  # [A]: the assignment at each sorted position
    plan: RaggedPlan
    back: _Exchange | None  # the exchange back; None where one device holds every slot


@dataclass(frozen=True)
class RaggedDispatch:
    """``moe.dropless_dispatch ragged`` over the experts (the module docstring)."""

    num_experts: int
    buffer_factor: float | None  # moe.ragged_buffer_factor

    def slots(
        self, choices: jax.Array, replica_table: jax.Array | None
    ) -> tuple[jax.Array, jax.Array | None, int]:
        """Each assignment's slot ``[T, k]``, the rows every source sends to every slot
        where known, and the slots: here an expert's one slot."""
        del replica_table
        return choices, None, self.num_experts

    def plan(
        self, route: RouterOutput, groups: RoutingGroups, replica_table: jax.Array | None
    ) -> RaggedPlan:
        del groups  # nothing drops: each device sends its own tokens' rows
        if role_size(EXPERT_TENSOR) > 1:
            raise ValueError(
                "moe.dropless_dispatch=ragged needs whole experts on each device: set "
                "parallel.expert_tensor 1, or moe.dropless_dispatch padded"
            )
        top_k = route.expert_index.shape[-1]
        slot, slot_counts, num_slots = self.slots(
            route.expert_index.reshape(-1, top_k), replica_table
        )
        weight = route.combine_weight.reshape(-1, top_k)
        return RaggedPlan(slot, weight, num_slots, replica_table, slot_counts)

    def send(self, x: jax.Array, plan: RaggedPlan) -> RaggedSent:
        """Sort this device's rows by slot and exchange them: steps 1-3 of the module
        docstring, up to the grouped GEMM."""
        tokens = x.reshape(-1, x.shape[-1])
        chex.assert_rank([tokens, plan.slot, plan.weight], 2)
        chex.assert_equal_shape((plan.slot, plan.weight))
        count, top_k = plan.slot.shape
        assignments = count * top_k
        axes = role_axes(EXPERT)
        group = role_size(EXPERT)
        slots = plan.num_slots // group
        flat = plan.slot.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        rows = jnp.take(tokens, order // top_k, axis=0)  # [A, d], by slot
        counts = jnp.zeros(plan.num_slots, jnp.int32).at[flat].add(1)
        if group == 1:
            return RaggedSent(rows, counts, counts, order, plan, None)
        bound = receive_bound(count, top_k, group, slots, self.buffer_factor)
        peer_rows = min(count * min(top_k, slots), bound)
        slot_counts = plan.slot_counts
        if slot_counts is None:
            slot_counts = jax.lax.all_gather(counts, axes)
        every = slot_counts  # [G, G S]: rows of each source per slot
        me = jax.lax.axis_index(axes)
        per_slot = every.reshape(group, group, slots)  # [source, destination, slot]
        # Where each source's rows for a destination's slot land in its buffer: slot-major,
        # then by source; the rows past the bound drop.
        slot_totals = jnp.sum(per_slot, axis=0)  # [destination, slot]
        offsets = _exclusive_cumsum(slot_totals, 1)[None] + _exclusive_cumsum(per_slot, 0)
        sent = jnp.clip(bound - offsets, 0, per_slot)
        # Where each slice starts among its source's sorted rows.
        starts = _exclusive_cumsum(every, 1).reshape(group, group, slots)

        def mine(a: jax.Array) -> jax.Array:  # as the source: [destination * slot]
            return jnp.take(a, me, axis=0).reshape(-1)

        def theirs(a: jax.Array) -> jax.Array:  # as the destination: [source * slot]
            return jnp.take(a, me, axis=1).reshape(-1)

        exchange = (axes, peer_rows, assignments)
        to_experts = _Exchange(
            mine(starts), mine(sent), mine(offsets), theirs(sent), theirs(offsets), *exchange
        )
        back = _Exchange(
            theirs(offsets), theirs(sent), theirs(starts), mine(sent), mine(starts), *exchange
        )
        received = to_experts.move(rows, bound)
        group_sizes = jnp.sum(jnp.take(sent, me, axis=1), axis=0)  # [slots]
        return RaggedSent(received, group_sizes, mine(sent), order, plan, back)

    def run_experts(self, experts: Experts, sent: RaggedSent) -> jax.Array:
        """The slots' rows through their experts, one grouped GEMM."""
        with ragged_scope(sent.order.shape[0]):
            return experts.grouped(sent.rows, sent.group_sizes, sent.plan.replica_table)

    def combine(self, outputs: jax.Array, sent: RaggedSent) -> jax.Array:
        """The outputs back to their sorted places, unsorted and summed by weight: ``[T, d]``
        (zeros where a row dropped)."""
        assignments = sent.order.shape[0]
        returned = outputs if sent.back is None else sent.back.move(outputs, assignments)
        count, top_k = sent.plan.slot.shape
        position = jnp.zeros(assignments, jnp.int32).at[sent.order].set(jnp.arange(assignments))
        per_assignment = jnp.take(returned, position, axis=0).reshape(count, top_k, -1)
        weight = sent.plan.weight.astype(per_assignment.dtype)
        return jnp.einsum("tkd,tk->td", per_assignment, weight)

    def stats(self, groups: RoutingGroups, sent: RaggedSent) -> DispatchStats:
        del groups
        return DispatchStats(dropped=sent.order.shape[0] - jnp.sum(sent.kept))
