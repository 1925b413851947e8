"""Pipeline parallelism inside the one per-device step (``parallel.pipeline``).

The model is cut for it by :mod:`jaxmoe.pipeline.model`; what every stage runs
alike (per-stage values, the ``ppermute`` between stages, the VJP picked per stage) is
:mod:`jaxmoe.pipeline.stage`.

The tick table (:mod:`jaxmoe.pipeline.ticks`) drives a Python loop, unrolled
at trace time like the layers: each tick has a forward slot and a backward slot, and in
each every stage runs the same chunk code on its own microbatch and chunk, picked from
the table by the stage's index on the ``pipeline`` axis. Where the table says a stage is
idle it runs that code on zeros with a zero cotangent, and what it computes is masked
out (a slot no stage uses is not emitted at all). Between ticks one
``jax.lax.ppermute`` over the pipeline axis hands each chunk's output to the next
chunk's stage, and one hands each chunk's input gradient back; both are equations of
the one per-device program, beside the expert all-to-alls, where the scheduler can
overlap them like any other collective.

**Forward and backward.** A forward slot runs ``jax.vjp`` of its chunk: the output goes
on, and the VJP (a pytree of the residuals) is kept until the backward slot of the same
microbatch and chunk, ``2 (C - 1 - c)`` ticks later. That distance depends on the chunk,
so on the stage: a backward slot picks, per stage, the residuals of the right earlier
forward slot (``lax.select_n`` over the at most P forward slots its stages need, under
``select_residuals``). A residual that is the chunk's parameters (a recomputed chunk keeps
its inputs) is not selected: the backward slot takes its own chunk's, the same values. Every
forward slot traces the same function on arguments of the same types (the per-stage
values it reads, the chunk and the microbatch, are traced even where every stage has
the same), so their residuals line up leaf for leaf and the VJP of one applies to the
residuals of another. Nothing is recomputed unless ``model.recompute`` says so
(``"layer"``: a chunk then keeps its blocks' inputs alone).

**Outside the blocks.** Every stage holds the embeddings, the final norm and the output
head (replicated over the pipeline axis). Stage 0 takes the embedding of the microbatch
entering the first chunk; the stage of the last chunk takes the logits and the loss,
and starts the backward pass from them in the same tick. Each is traced once per
microbatch and computed by every stage on its own activations, the loss weighted by a
zero cotangent off the last stage: SPMD has no per-stage code. In the lockstep ticks
this costs no time (the other stages wait for the last one anyway) but the head's
FLOPs once per stage. Their gradients are summed over the pipeline axis by the gradient
synchronisation, as for any parameter the axis does not split; the stages that did not
use them add zeros.

**Uneven chunks** (``parallel.chunk_layers``). The stack has as many positions as the
longest chunk; where a stage's chunk is shorter, the positions past its layers are
padding (:mod:`jaxmoe.pipeline.params`). Every stage still runs every position
(SPMD), and a padding position's output is its input and its routing stats zeros, so its
parameters get zero gradients and nothing of it reaches the loss or the metrics. The
ticks stay lockstep: a stage with fewer layers waits for the longest chunk, so uneven
chunks admit layer counts that the chunks do not divide; they do not shorten a tick.

**Under ZeRO-1** (``train.zero`` 1) the step gathers every parameter before the first
tick, the stacked blocks included (:func:`~jaxmoe.pipeline.params.
stacked_zero_layout`); the ticks compute with the gathered parameters, sum their gradients
in the shards' dtype (float32), and the step reduce-scatters them after the last tick.

**What each microbatch sees** is what it sees without the pipeline: its rows
(:func:`~jaxmoe.pipeline.microbatches.microbatch_rows`), the same router noise (the step's
key folded with the microbatch and the layer), the same replica table and expert bias
of each layer, its document masks. The losses are scaled as in
:mod:`jaxmoe.losses`, so the gradients sum to those of the step's mean loss;
each block's gradients are summed over the microbatches in their order, as the
microbatch loop sums them. The routing stats of a device's layers land in their rows
of ``[moe_layers, ...]``, zeros elsewhere, summed over the pipeline axis with the
metrics' other sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import Config
from jaxmoe.data.documents import document_masks
from jaxmoe.layers import GPTMoE, RoutingStats
from jaxmoe.layers.recompute import call_block
from jaxmoe.layers.rotary import attention_tables
from jaxmoe.losses import Losses, cross_entropy, router_losses
from jaxmoe.pipeline.microbatches import microbatch_rows
from jaxmoe.pipeline.model import PipelineModel
from jaxmoe.pipeline.params import STAGE_BLOCKS
from jaxmoe.pipeline.stage import Stage, select_vjp, shift
from jaxmoe.pipeline.ticks import TICK_SCOPE, Slot, Tick

PyTree = Any
# Where a slot's input comes from, per stage.
_IDLE, _LOCAL, _RECEIVED = 0, 1, 2
# Where a backward slot picks, per stage, the residuals of its forward slot.
SELECT_SCOPE = "select_residuals"


@dataclass(frozen=True)
class _Microbatch:
    rows: jax.Array  # [rows, seq_len + 1]
    positions: jax.Array | None  # [rows, seq_len] under document masks
    segment_ids: jax.Array | None


def _index_tree(tree: PyTree, index: int | jax.Array) -> PyTree:
    """Every leaf's ``[index]`` along its leading axis (static or traced)."""
    if isinstance(index, int):
        return jax.tree.map(lambda a: a[index], tree)
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def _add_at(stack: PyTree, index: int | jax.Array, value: PyTree) -> PyTree:
    """``stack[index] += value`` on every leaf (leading axis; one addition per element, in
    the stack's dtype), behind an ``optimization_barrier`` (as :func:`_add`): an
    elementwise sum where the stack is one chunk (a scatter would read and write the cast
    value as a buffer of its own: XLA does not fuse into a scatter what it fuses into a
    sum), else a scatter at a static index and a row updated in place at a traced one."""

    def add(a: jax.Array, v: jax.Array) -> jax.Array:
        v = v.astype(a.dtype)
        if a.shape[0] == 1:
            return a + v[None]
        if isinstance(index, int):
            return a.at[index].add(v)
        row = jax.lax.dynamic_index_in_dim(a, index, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(a, row + v, index, axis=0)

    return jax.lax.optimization_barrier(jax.tree.map(add, stack, value))


def _add(total: PyTree | None, value: PyTree, dtypes: PyTree) -> PyTree:
    """``total + value`` leaf by leaf, in ``dtypes``, behind an ``optimization_barrier``:
    each slot's sum is a buffer of its own. Unbarred, the sums over the ticks are one
    chain of elementwise adds that XLA fuses into one kernel at the last tick, which
    holds every slot's gradients until then (a ``[vocab, d_model]`` head and embedding
    gradient per microbatch)."""
    value = jax.tree.map(lambda v, dtype: v.astype(dtype), value, dtypes)
    summed = value if total is None else jax.tree.map(jnp.add, total, value)
    return jax.lax.optimization_barrier(summed)


class _Pipeline:
    """One step's pipelined passes over this device's microbatches (see the module
    docstring): :meth:`gradients` for the train step, :meth:`losses` (forward slots
    alone) for evaluation."""

    def __init__(
        self,
        config: Config,
        model: PipelineModel,
        params: PyTree,
        batch: jax.Array,
        key: jax.Array | None,
        placement: jax.Array | None,
        model_state: PyTree,
        eod_id: int | None,
        denominator: jax.Array,
        accumulate_like: PyTree | None = None,
    ):
        self.config = config
        self.model = model
        self.layout = self.model.layout
        self.ticks = self.model.ticks
        self.stage = Stage(self.layout.stages)
        self.outside = {name: value for name, value in params.items() if name != STAGE_BLOCKS}
        # This device's chunks: [V, ...] (its block of the stage dimension is 1).
        self.stacks = jax.tree.map(lambda a: a[:, 0], params[STAGE_BLOCKS])
        # The dtypes the gradients are summed in: the parameters' own, or those of
        # ``accumulate_like`` (ZeRO-1's float32 shards of parameters gathered in bfloat16).
        dtypes = jax.tree.map(
            lambda a: a.dtype, params if accumulate_like is None else accumulate_like
        )
        self.outside_dtypes = {k: v for k, v in dtypes.items() if k != STAGE_BLOCKS}
        self.block_dtypes = dtypes[STAGE_BLOCKS]
        self.key = key
        self.placement = placement
        self.eod_id = eod_id
        self.denominator = denominator
        self.shards = config.parallel.token_shards
        self.microbatches = config.train.microbatches
        self.inputs = [self._microbatch(rows) for rows in microbatch_rows(batch, self.microbatches)]
        self.segment_ids = (
            None if eod_id is None else jnp.stack([mb.segment_ids for mb in self.inputs])
        )
        self.rotary = self._rotary_tables()
        self.biases = self._stacked_biases(model_state)
        # What the ticks accumulate.
        self.vjps: dict[int, Any] = {}  # forward tick -> the VJP of its chunk
        self.vjp_params: dict[int, Any] = {}  # forward tick -> its chunk's parameters
        self.embed_vjps: dict[int, Any] = {}  # microbatch -> the VJP of its embedding
        self.received = self.received_grad = self.zeros = None
        self.outside_grads = None
        self.block_grads = None
        self.cross_entropy = self.routers = jnp.float32(0)
        self.stats: RoutingStats | None = None

    # -- what a slot reads -------------------------------------------------------------

    def _microbatch(self, rows: jax.Array) -> _Microbatch:
        if self.eod_id is None:
            return _Microbatch(rows, None, None)
        masks = document_masks(rows, self.eod_id)
        return _Microbatch(rows, masks.positions, masks.segment_ids)

    def _rotary_tables(self) -> Any:
        """Rotary tables: one for every microbatch, or ``[M, ...]`` stacked when document
        masks give each row positions of its own (None: learned positions)."""
        model = self.config.model
        if model.position != "rope":
            return None
        if self.eod_id is None:
            return attention_tables(model, jnp.arange(model.seq_len))
        tables = [attention_tables(model, mb.positions) for mb in self.inputs]
        return jax.tree.map(lambda *t: jnp.stack(t), *tables)

    def _stacked_biases(self, model_state: PyTree) -> list[PyTree]:
        """Per chunk position, its blocks' expert biases stacked over the chunks ``[C,
        ...]`` (None: a dense position, or no biases)."""
        if model_state is None:
            return [None] * self.layout.per_chunk
        blocks, layout = model_state["blocks"], self.layout
        stacked = []
        for j, rank in enumerate(self.model.moe_rank):
            slots = layout.chunk_slots()
            held = [layout.layer(v, s, j) for v, s in slots if layout.holds(v, s, j)]
            if rank is None or held[0] not in blocks:
                stacked.append(None)
                continue
            padding = jax.tree.map(jnp.zeros_like, blocks[held[0]])
            rows = [
                blocks[layout.layer(v, s, j)] if layout.holds(v, s, j) else padding
                for v, s in slots
            ]
            stacked.append(jax.tree.map(lambda *b: jnp.stack(b), *rows))
        return stacked

    def _outside_model(self, params: PyTree) -> GPTMoE:
        return nnx.merge(self.model.outside, params)

    # -- the chunk ---------------------------------------------------------------------

    def _chunk_context(self, slots: tuple[Slot | None, ...]) -> dict[str, Any]:
        """What the chunk each stage runs reads besides its parameters and input: traced
        values only, so that every forward slot traces the same function."""
        stage, layout = self.stage, self.layout
        virtual = stage.traced([slot.virtual if slot else 0 for slot in slots])
        microbatch = stage.traced([slot.microbatch if slot else 0 for slot in slots])
        context: dict[str, Any] = {"chunk": virtual * layout.stages + stage.index}
        if self.key is not None:
            context["key"] = (
                jax.random.fold_in(self.key, microbatch) if self.microbatches > 1 else self.key
            )
        if self.rotary is not None:
            context["rotary"] = (
                self.rotary if self.eod_id is None else _index_tree(self.rotary, microbatch)
            )
        if self.segment_ids is not None:
            context["segment_ids"] = _index_tree(self.segment_ids, microbatch)
        return context

    def _run_chunk(
        self, params: PyTree, x: jax.Array, context: dict[str, Any]
    ) -> tuple[tuple[jax.Array, jax.Array], RoutingStats]:
        """The chunk's blocks on ``x``: ``((y, its router losses), routing stats stacked
        over its MoE blocks)``."""
        layout, model = self.layout, self.model
        chunk = context["chunk"]
        offset = jnp.asarray([layout.offset(c) for c in range(layout.chunks)], jnp.int32)[chunk]
        counts = jnp.asarray(layout.counts, jnp.int32)[chunk]
        moe_rows = jnp.asarray(model.moe_rows, jnp.int32)[chunk] if model.moe_per_chunk else None
        layer_stats = []
        for j, graphdef in enumerate(model.blocks):
            states = [params[j]]
            if self.biases[j] is not None:
                states.append(_index_tree(self.biases[j], chunk))
            block = nnx.merge(graphdef, *states)
            layer = offset + j
            key = None if "key" not in context else jax.random.fold_in(context["key"], layer)
            table = None
            rank = model.moe_rank[j]
            if self.placement is not None and rank is not None:
                table = _index_tree(self.placement, moe_rows[rank])
            # Under ZeRO-1 the parameters were gathered before the first tick.
            with jax.named_scope(f"chunk_layer_{j}"):
                y, stats = call_block(
                    self.config.model.recompute, block, j, x, key, table,
                    context.get("rotary"), context.get("segment_ids"),
                )  # fmt: skip
            if j >= min(layout.counts):  # padding in some chunk: there, the block is skipped
                held = j < counts
                y = jnp.where(held, y, x)
                stats = None if stats is None else _masked_stats(stats, held)
            x = y
            if stats is not None:
                layer_stats.append(stats)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layer_stats)
        return (x, router_losses(self.config.moe, stacked)), stacked

    def _chunk_params(
        self, virtual: int | jax.Array, slot_input: jax.Array
    ) -> tuple[PyTree, jax.Array]:
        """This stage's parameters of its chunk ``virtual`` for a slot reading
        ``slot_input``. With more than one chunk, the index passes an
        ``optimization_barrier`` with the slot's input first, so that each slot slices the
        stack anew: otherwise the slices of all the slots with the same index (or per-stage
        table of indices) are one value to XLA's CSE, alive from the first slot to the
        last, a second copy of a chunk's parameters for each index. (One chunk is the
        whole stack: its slice is a view.)"""
        if self.layout.virtual > 1:
            virtual, slot_input = jax.lax.optimization_barrier(
                (jnp.asarray(virtual, jnp.int32), slot_input)
            )
        return _index_tree(self.stacks, virtual), slot_input

    # -- the passes --------------------------------------------------------------------

    def gradients(self) -> tuple[Losses, PyTree]:
        """This device's losses and gradients (before their synchronisation)."""
        self.block_grads = jax.tree.map(
            lambda a, dtype: jnp.zeros(a.shape, dtype), self.stacks, self.block_dtypes
        )
        for tick in self.ticks.ticks:
            with jax.named_scope(TICK_SCOPE.format(tick.index)):
                head_grad = self._forward(tick, differentiate=True) if tick.has_forward else None
                if tick.has_backward:
                    self._backward(tick, head_grad)
        grads = {
            **self.outside_grads,
            STAGE_BLOCKS: jax.tree.map(lambda g: g[:, None], self.block_grads),
        }
        return self._losses(), grads

    def losses(self) -> Losses:
        """This device's losses: the forward slots alone."""
        for tick in self.ticks.ticks:
            if tick.has_forward:
                with jax.named_scope(TICK_SCOPE.format(tick.index)):
                    self._forward(tick, differentiate=False)
        return self._losses()

    def _losses(self) -> Losses:
        total = self.cross_entropy + self.routers / self.microbatches
        return Losses(total, self.cross_entropy, self._finish_stats(self.stats))

    def _following(self, tick: Tick) -> Tick | None:
        ticks = self.ticks.ticks
        return ticks[tick.index + 1] if tick.index + 1 < len(ticks) else None

    def _forward(self, tick: Tick, differentiate: bool) -> jax.Array | None:
        """The forward slot: each stage's chunk on its input (the embedding on stage 0's
        first chunk, else what the previous chunk's stage sent), the loss where the last
        chunk ran. Differentiating, returns the loss's gradient for the last chunk's
        output (None when no stage ran the last chunk)."""
        stage, stages, virtual = self.stage, self.layout.stages, self.layout.virtual
        slots = tick.forward
        embedded = None
        first = slots[0]
        if first is not None and first.virtual == 0:
            inputs = self.inputs[first.microbatch]
            if differentiate:
                embedded, self.embed_vjps[first.microbatch] = jax.vjp(
                    lambda p: self._embed(p, inputs), self.outside
                )
            else:
                embedded = self._embed(self.outside, inputs)
            if self.zeros is None:
                self.zeros = jnp.zeros_like(embedded)
        sources = [
            _IDLE if slot is None
            else _LOCAL if s == 0 and slot.virtual == 0
            else _RECEIVED
            for s, slot in enumerate(slots)
        ]  # fmt: skip
        x = stage.where(sources, {_IDLE: self.zeros, _LOCAL: embedded, _RECEIVED: self.received})
        context = self._chunk_context(slots)
        params, x = self._chunk_params(stage.pick([s.virtual if s else 0 for s in slots]), x)
        if differentiate:
            self.vjp_params[tick.index] = params
            (y, routers), self.vjps[tick.index], stats = jax.vjp(
                lambda p, x_: self._run_chunk(p, x_, context), params, x, has_aux=True
            )
        else:
            (y, routers), stats = self._run_chunk(params, x, context)
        active = stage.pick([slot is not None for slot in slots])
        self.routers = self.routers + jnp.where(active, routers, 0.0)
        self.stats = self._add_stats(self.stats, stats, context["chunk"], active)
        head_grad = None
        last = slots[stages - 1]
        if last is not None and last.virtual == virtual - 1:
            loss, head_grad, grads = self._head(y, last.microbatch, differentiate)
            self.cross_entropy = self.cross_entropy + loss
            if differentiate:
                self.outside_grads = _add(self.outside_grads, grads, self.outside_dtypes)
        following = self._following(tick)
        if following is not None and any(
            slot is not None and (s > 0 or slot.virtual > 0)
            for s, slot in enumerate(following.forward)
        ):
            with jax.named_scope("send_activations"):
                self.received = shift(y, stages, 1, circular=virtual > 1)
        return head_grad

    def _backward(self, tick: Tick, head_grad: jax.Array | None) -> None:
        """The backward slot: each stage's chunk's VJP on the gradient of its output (the
        loss's on the last chunk, else what the next chunk's stage sent), the gradients
        added to its chunk's, and the embedding's backward where stage 0 ran chunk 0."""
        stage, ticks = self.stage, self.ticks
        stages, virtual = self.layout.stages, self.layout.virtual
        slots = tick.backward
        sources = [
            _IDLE if slot is None
            else _LOCAL if s == stages - 1 and slot.virtual == virtual - 1
            else _RECEIVED
            for s, slot in enumerate(slots)
        ]  # fmt: skip
        cotangent = stage.where(
            sources, {_IDLE: self.zeros, _LOCAL: head_grad, _RECEIVED: self.received_grad}
        )
        forward_ticks = [
            tick.index - ticks.distance(ticks.chunk(s, slot.virtual)) if slot else None
            for s, slot in enumerate(slots)
        ]
        candidates = sorted({t for t in forward_ticks if t is not None})
        which = stage.pick([candidates.index(t) if t is not None else 0 for t in forward_ticks])
        virtual_index = stage.pick([slot.virtual if slot else 0 for slot in slots])
        picked, cotangent = self._chunk_params(virtual_index, cotangent)
        with jax.named_scope(SELECT_SCOPE):
            vjp = select_vjp(
                [self.vjps[t] for t in candidates],
                which,
                [self.vjp_params[t] for t in candidates],
                picked,
            )
        active = stage.pick([slot is not None for slot in slots])
        weight = jnp.where(active, 1.0 / (self.microbatches * self.shards), 0.0)
        chunk_grads, input_grad = vjp((cotangent, weight.astype(jnp.float32)))
        self.block_grads = _add_at(self.block_grads, virtual_index, chunk_grads)
        first = slots[0]
        if first is not None and first.virtual == 0:
            (grads,) = self.embed_vjps.pop(first.microbatch)(
                jnp.where(stage.index == 0, input_grad, jnp.zeros_like(input_grad))
            )
            self.outside_grads = _add(self.outside_grads, grads, self.outside_dtypes)
        following = self._following(tick)
        if following is not None and any(
            slot is not None and not (s == stages - 1 and slot.virtual == virtual - 1)
            for s, slot in enumerate(following.backward)
        ):
            with jax.named_scope("send_gradients"):
                self.received_grad = shift(input_grad, stages, -1, circular=virtual > 1)

    def _embed(self, params: PyTree, microbatch: _Microbatch) -> jax.Array:
        x, _ = self._outside_model(params).embed(microbatch.rows[:, :-1], microbatch.positions)
        return x

    def _head(
        self, y: jax.Array, microbatch: int, differentiate: bool
    ) -> tuple[jax.Array, jax.Array | None, PyTree]:
        """The loss of ``microbatch`` from the last chunk's output ``y`` (every stage
        computes it on its own ``y``; only the last stage's counts): ``(loss, its gradient
        for y, its gradients for the parameters outside the blocks)``, the gradients None
        unless ``differentiate``."""
        rows = self.inputs[microbatch].rows
        last = self.stage.index == self.layout.stages - 1

        def loss(params: PyTree, y: jax.Array) -> jax.Array:
            logits = self._outside_model(params).logits(y)
            return cross_entropy(logits, rows, self.eod_id, self.denominator)

        with jax.named_scope("head"):
            if not differentiate:
                return jnp.where(last, loss(self.outside, y), 0.0), None, None
            value, vjp = jax.vjp(loss, self.outside, y)
            grads, head_grad = vjp(jnp.where(last, 1.0 / self.shards, 0.0).astype(value.dtype))
        return jnp.where(last, value, 0.0), head_grad, grads

    # -- routing stats -----------------------------------------------------------------

    def _add_stats(
        self, total: RoutingStats | None, stats: RoutingStats, chunk: jax.Array, active: Any
    ) -> RoutingStats:
        """``total`` (``[moe_layers, ...]``) with this slot's stats added at its chunk's
        rows (nothing where the slot is idle)."""
        layers = len(self.config.model.moe_layers)
        rows = jnp.asarray(self.model.moe_rows, jnp.int32)[chunk]

        def add(sum_: jax.Array | None, value: jax.Array | None) -> jax.Array | None:
            if value is None:
                return None
            value = jnp.where(active, value, jnp.zeros_like(value))
            if sum_ is None:
                sum_ = jnp.zeros((layers, *value.shape[1:]), value.dtype)
            return sum_.at[rows].add(value)  # a padding block's stats are zeros, at row 0

        previous = [None] * len(stats) if total is None else list(total)
        return RoutingStats(*(add(s, v) for s, v in zip(previous, stats, strict=True)))

    def _finish_stats(self, total: RoutingStats) -> RoutingStats:
        """Counts summed over the microbatches, losses averaged (as
        :func:`~jaxmoe.pipeline.microbatches.combine_stats`)."""

        def finish(value: jax.Array | None) -> jax.Array | None:
            if value is None or jnp.issubdtype(value.dtype, jnp.integer):
                return value
            return value / self.microbatches

        return RoutingStats(*(finish(value) for value in total))


def _masked_stats(stats: RoutingStats, held: jax.Array) -> RoutingStats:
    """A block's routing stats where it is a layer, zeros where it is padding."""
    return RoutingStats(
        *(None if v is None else jnp.where(held, v, jnp.zeros_like(v)) for v in stats)
    )


def pipelined_gradients(
    config: Config,
    model: PipelineModel,
    params: PyTree,
    batch: jax.Array,
    key: jax.Array | None,
    placement: jax.Array | None,
    model_state: PyTree,
    eod_id: int | None,
    denominator: jax.Array,
    accumulate_like: PyTree | None = None,
) -> tuple[Losses, PyTree]:
    """This device's losses over its rows of ``batch`` (summed over the microbatches, as
    the microbatch loop sums them), and the gradients of its stage's parameters (the
    stacked layout of :mod:`jaxmoe.pipeline.params`), before their
    synchronisation, summed in the dtypes of ``accumulate_like``'s leaves (None: those of
    ``params``). Inside the whole-mesh ``shard_map``."""
    return _Pipeline(
        config, model, params, batch, key, placement, model_state, eod_id, denominator,
        accumulate_like,
    ).gradients()  # fmt: skip


def pipelined_losses(
    config: Config,
    model: PipelineModel,
    params: PyTree,
    batch: jax.Array,
    placement: jax.Array | None,
    model_state: PyTree,
    eod_id: int | None,
    denominator: jax.Array,
) -> Losses:
    """This device's losses over its rows of ``batch``, the forward slots alone (no router
    noise): the evaluation step's. Inside the whole-mesh ``shard_map``."""
    return _Pipeline(
        config, model, params, batch, None, placement, model_state, eod_id, denominator
    ).losses()
