"""What a fusing compiler keeps out of memory: the values of a program that get no buffer.

One rule, read by the time model (:class:`~scheduling.costs.cost_model.CostModel`: an op
pays for the buffers it reads and writes, and a launch only when it writes one) and by
the memory walk of a step (which gives such values no bytes), so that both agree about
what XLA fuses:

- *Loop fusion.* The value of an elementwise, layout or slicing op (:data:`LOOP_FUSIBLE`:
  slices, pads, concatenations and gathers too) whose readers all compute their operands
  inline (:data:`FUSING_READERS`: those ops, reductions, and updates in place) is fused
  into them, unless the op is expensive (:func:`is_expensive`) and read more than once:
  XLA repeats a cheap producer in each reader, never an expensive one. A reader of a fused
  value reads the fused op's operands instead, through any chain of fused values; of a
  fused slice or gather, the part it takes.
- *Slices read their part.* A slice, dynamic slice or gather reads the elements it
  takes, not its whole operand.
- *Updates in place.* A ``dynamic_update_slice`` or scatter (:data:`IN_PLACE`) writes into
  its first operand's buffer: it reads its update (and indices) and writes the region it
  updates (a combining scatter reads that region too), not the whole buffer. Where that
  operand is a fused value (a broadcast of zeros, say) there is no buffer to update: the
  kernel writes the whole result.
- *Identities.* A ``reduce_precision`` to its dtype's own precision (what JAX puts on the
  values a remat region saves) is dropped (:func:`is_identity`), and so is a sum with
  zeros (:func:`sum_with_zeros`: a literal zero, broadcast, cast or reshaped, as JAX makes the
  gradient of an input a function does not use; XLA's simplifier takes ``x + 0`` for
  ``x``): it moves nothing and its readers read its operand.
- *Multi-output fusion.* An elementwise or reduction op that reads the buffer of an
  elementwise op (one that gets a buffer because it is returned, or read elsewhere), or
  a buffer that an earlier such kernel reads, joins that kernel where both loop over as
  many elements (a reduction over its operand's) and nothing else it reads depends on
  the kernel (a scalar included: an update scaled by a norm the kernel reduces waits for
  it): the kernel writes both values and reads each buffer once (an optimizer's update:
  the new moments and parameters from one pass over the old). A loss's gradient over
  the vocabulary does not join the scalar sum of its tokens' losses.
- *One kernel.* The ops under a name scope :data:`scheduling.names.ONE_KERNEL_SCOPE`
  run as one kernel on a target that has one for them (cuDNN's flash attention for an
  attention core): a value made and read only inside one such scope (the same scope
  path) stays on chip. Only a profile with ``fused_kernels`` prices them so.

The values a program returns always get buffers; so do those of matmuls, collectives,
updates in place and control flow, whoever reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax.numpy as jnp

from scheduling.names import ONE_KERNEL_SCOPE
from scheduling.program.capture import aval_bytes

# Elementwise and layout ops: XLA fuses their values into the ops that read them.
FUSIBLE = frozenset(
    {"add", "add_any", "sub", "mul", "div", "rem", "neg", "abs", "sign", "square", "sqrt",
     "rsqrt", "cbrt", "exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "logistic", "sin",
     "cos", "atan2", "erf", "erf_inv", "pow", "integer_pow", "one_minus_square", "polynomial",
     "max", "min", "clamp",
     "floor", "ceil", "round", "nextafter", "is_finite", "convert_element_type",
     "select_n", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
     "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
     "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "iota", "copy",
     "copy_p", "stop_gradient", "pvary"}
)  # fmt: skip
# Fused ops that XLA computes once rather than repeat in each reader.
EXPENSIVE = frozenset(
    {"div", "rem", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "expm1", "log", "log1p", "log2", "tanh",
     "logistic", "sin", "cos", "atan2", "erf", "erf_inv", "pow"}
)  # fmt: skip
# Of those, the ops XLA:GPU repeats like cheap ones in float32 and float16, where the GPU
# computes them in an instruction or two (its fusion's ``IsExpensive``): a softmax's
# exponential is computed again in each kernel that reads it, not written out.
CHEAP_IN_FLOAT = frozenset({"div", "sqrt", "rsqrt", "exp"})
# Ops that take a part of their first operand: they read that part alone.
SLICING = frozenset({"slice", "dynamic_slice", "gather"})
# Producers XLA fuses into their readers' loops: the fusible ops, slicing, padding and
# concatenation.
LOOP_FUSIBLE = FUSIBLE | SLICING | frozenset({"pad", "concatenate"})
# Ops that write into their first operand's buffer (XLA updates it in place): the operand
# index of the update they write there, and whether they read the region they update.
IN_PLACE = {
    "dynamic_update_slice": (1, False),
    "scatter": (2, False),
    "scatter-add": (2, True),
    "scatter_add": (2, True),
    "scatter-mul": (2, True),
    "scatter-min": (2, True),
    "scatter-max": (2, True),
}
# Reductions: their loop runs over their operand, not their result.
REDUCING = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
     "argmax", "argmin", "cumsum", "cumlogsumexp", "cummax", "cummin"}
)  # fmt: skip
# Ops that read fused operands (compute them inline): the loop-fusible ops, reductions,
# and updates in place.
FUSING_READERS = LOOP_FUSIBLE | IN_PLACE.keys() | REDUCING


def is_expensive(primitive: str, dtype: Any) -> bool:
    """Whether XLA computes a fused ``primitive`` op's value of ``dtype`` once rather than
    repeat it in each reader."""
    if primitive in CHEAP_IN_FLOAT and dtype in (jnp.float32, jnp.float16):
        return False
    return primitive in EXPENSIVE


def fuses_into_readers(primitive: str, dtype: Any, readers: Sequence[str]) -> bool:
    """Whether the value (of ``dtype``) of a ``primitive`` op that ``readers`` read gets no
    buffer."""
    return (
        primitive in LOOP_FUSIBLE
        and all(reader in FUSING_READERS for reader in readers)
        and (len(readers) <= 1 or not is_expensive(primitive, dtype))
    )


# Ops whose value is zeros everywhere where their operand is: casts and layout ops.
KEEPS_ZEROS = frozenset(
    {"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "expand_dims",
     "transpose", "copy", "copy_p", "pvary"}
)  # fmt: skip
ADDING = frozenset({"add", "add_any"})


def zero_values(ops: Iterable[Any]) -> set[int]:
    """The ``id`` of each value of ``ops`` that is zeros everywhere: a scalar literal zero
    cast, broadcast or reshaped (:data:`KEEPS_ZEROS`), through any chain of them."""
    zeros: set[int] = set()
    for op in ops:
        if op.primitive in KEEPS_ZEROS and op.inputs and _is_zero(op.inputs[0], zeros):
            zeros.update(id(value) for value in op.outputs)
    return zeros


def _is_zero(atom: Any, zeros: set[int]) -> bool:
    if id(atom) in zeros:
        return True
    # A captured program's constant (value) or a body's literal (val); a variable has neither.
    value = getattr(atom, "value", getattr(atom, "val", None))
    return value is not None and not getattr(value, "shape", ()) and bool(value == 0)


def sum_with_zeros(op: Any, zeros: set[int]) -> Any | None:
    """The operand ``op`` returns where it adds zeros (the ``id`` of its values in
    ``zeros``: :func:`zero_values`) to a value of its result's type, which XLA's simplifier
    takes for the sum (None where it does not)."""
    if op.primitive not in ADDING or len(op.inputs) != 2 or len(op.outputs) != 1:
        return None
    first, second = op.inputs
    result = op.outputs[0].aval
    for kept, added in ((first, second), (second, first)):
        same_type = (kept.aval.shape, kept.aval.dtype) == (result.shape, result.dtype)
        if id(added) in zeros and same_type:
            return kept
    return None


def is_identity(op: Any) -> bool:
    """Whether ``op`` leaves its operand as it is: a ``reduce_precision`` to no fewer bits
    than its dtype has (XLA's simplifier drops it)."""
    if op.primitive != "reduce_precision":
        return False
    dtype = op.inputs[0].aval.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    info, params = jnp.finfo(dtype), op.eqn.params
    return params["exponent_bits"] >= info.nexp and params["mantissa_bits"] >= info.nmant


def region_bytes(op: Any) -> int:
    """The bytes an update in place (:data:`IN_PLACE`) writes: its update's."""
    return aval_bytes(op.inputs[IN_PLACE[op.primitive][0]].aval)


def in_place_bytes(op: Any, update_reads: float) -> float:
    """Bytes an update in place moves: what it reads besides its first operand
    (``update_reads``), and the region it writes (and reads, where it combines)."""
    _, combines = IN_PLACE[op.primitive]
    return update_reads + region_bytes(op) * (2 if combines else 1)


def kernel_scope(name_stack: str) -> str | None:
    """The path of the innermost one-kernel scope an op runs under (None: none): ops of the
    same path run in one kernel."""
    parts = name_stack.split("/")
    for end in range(len(parts), 0, -1):
        if parts[end - 1] == ONE_KERNEL_SCOPE:
            return "/".join(parts[:end])
    return None


def _loop_elements(op: Any) -> int:
    """The elements of the loop that computes ``op`` in a kernel: a reduction's operand's,
    else its largest result's. XLA fuses ops of one loop alone into a kernel of several
    results."""
    if op.primitive in REDUCING and op.inputs:
        shapes = [getattr(op.inputs[0].aval, "shape", ())]
    else:
        shapes = [getattr(value.aval, "shape", ()) for value in op.outputs]
    return max((math.prod(shape) for shape in shapes), default=1)


class Fusion:
    """The fused values of one program (its ops in order, and what it returns).

    Works on any ops with ``primitive``, ``inputs``, ``outputs`` and ``name_stack``: a
    captured program's, or a control-flow body's (JAX variables and literals). Values are
    told apart by identity.
    """

    def __init__(self, ops: Sequence[Any], outputs: Iterable[Any], kernels: bool = False):
        self._producer: dict[int, Any] = {}
        # Ops XLA drops (their values are their operands'): no FLOPs, no bytes, no launch.
        self._dropped = {id(op) for op in ops if is_identity(op)}
        zeros = zero_values(ops)
        taken: dict[int, Any] = {}  # a sum with zeros -> the operand XLA takes for it
        readers: dict[int, list[Any]] = {}  # the readers of a sum with zeros read its operand
        for op in ops:
            for value in op.outputs:
                self._producer[id(value)] = op
            operand = sum_with_zeros(op, zeros)
            if operand is not None:
                self._dropped.add(id(op))
                taken[id(op.outputs[0])] = taken.get(id(operand), operand)
                continue
            for atom in op.inputs:
                readers.setdefault(id(taken.get(id(atom), atom)), []).append(op)
        returned = {id(taken.get(id(atom), atom)) for atom in outputs}
        self._known = {id(op) for op in ops}
        self._fused: set[int] = set()  # repeated in each reader: read through
        self._on_chip: set[int] = set()  # kept inside one kernel: free
        for op in ops:
            scope = kernel_scope(op.name_stack) if kernels else None
            for value in op.outputs:
                if id(value) in returned:
                    continue
                read_by = readers.get(id(value), [])
                if scope and read_by and all(kernel_scope(r.name_stack) == scope for r in read_by):
                    self._on_chip.add(id(value))
                elif id(op) in self._dropped or fuses_into_readers(
                    op.primitive, getattr(value.aval, "dtype", None), [r.primitive for r in read_by]
                ):
                    self._fused.add(id(value))
        self._reads: dict[int, dict[Any, float]] = {}
        self._index = {id(op): index for index, op in enumerate(ops)}
        self._joined: set[int] = set()  # ops that run in an earlier op's kernel
        self._kernel_of: dict[int, int] = {}  # op -> the first op of its kernel
        self._bytes = self._kernel_bytes(ops)

    def _kernel_bytes(self, ops: Sequence[Any]) -> dict[int, float]:
        """Each op's bytes, in program order: a kernel joined to an earlier one (multi-output
        fusion) reads only what that kernel has not read."""
        members: dict[int, set[int]] = {}  # a kernel (its first op) -> its ops
        kernel_of = self._kernel_of  # op -> its kernel
        first: dict[int, int] = {}  # a kernel -> the program index of its first op
        kernel_reads: dict[int, set[Any]] = {}  # a kernel -> the buffers it reads
        loop: dict[int, int] = {}  # a kernel -> the elements its loop runs over
        reading: dict[Any, int] = {}  # a buffer -> the last kernel of fusing ops reading it
        own_reads: dict[int, dict[Any, float]] = {}
        found: dict[int, float] = {}
        for index, op in enumerate(ops):
            key = id(op)
            if op.outputs and all(id(value) in self._fused for value in op.outputs):
                found[key] = 0.0
                continue
            reads = dict(self._operand_reads(op))
            kernel = key
            elements = _loop_elements(op)
            if op.primitive in FUSING_READERS and op.primitive not in IN_PLACE:
                # Producer and consumer: read what the producer read instead (of every
                # producer in the kernel joined).
                for value_id in list(reads):
                    producer = self._producer.get(value_id)
                    if producer is None or producer.primitive not in FUSIBLE:
                        continue
                    if id(producer) not in own_reads:
                        continue
                    joined = kernel_of[id(producer)]
                    if kernel not in (key, joined):
                        continue  # one kernel joined at most
                    # Whether op depends on the kernel does not change with the producer.
                    if kernel == joined or (
                        loop[joined] == elements
                        and self._independent(op, members[joined], first[joined])
                    ):
                        del reads[value_id]
                        reads.update(own_reads[id(producer)])
                        kernel = joined
                # Siblings: a kernel of fusing ops that read one of the same buffers.
                if kernel == key:
                    for value_id in reads:
                        joined = reading.get(value_id)
                        if (
                            joined is not None
                            and loop[joined] == elements
                            and self._independent(op, members[joined], first[joined])
                        ):
                            kernel = joined
                            break
                for value_id in reads:
                    reading[value_id] = kernel
            if kernel == key:
                members[key], first[key], kernel_reads[key] = set(), index, set()
                loop[key] = elements
            else:
                self._joined.add(key)
            members[kernel].add(key)
            kernel_of[key] = kernel
            own_reads[key] = reads
            charged = kernel_reads[kernel]
            fresh = sum(size for value_id, size in reads.items() if value_id not in charged)
            charged.update(reads)
            if self._updates_in_place(op):
                found[key] = float(in_place_bytes(op, fresh))
                continue
            writes = sum(aval_bytes(v.aval) for v in op.outputs if not self.is_fused(v))
            found[key] = float(fresh + writes)
        return found

    def _updates_in_place(self, op: Any) -> bool:
        """Whether ``op`` writes into its first operand's buffer: an update in place whose
        first operand is a buffer (not a value computed in its kernel)."""
        return op.primitive in IN_PLACE and not self.is_fused(op.inputs[0])

    def _operand_reads(self, op: Any) -> dict[Any, float]:
        """The buffers (a key each -> bytes) ``op`` reads through its operands: a slice the
        part it takes (:data:`SLICING`), an update in place all but the buffer it updates."""
        reads: dict[Any, float] = {}
        for position, atom in enumerate(op.inputs):
            if position == 0 and self._updates_in_place(op):
                continue
            if position == 0 and op.primitive in SLICING and getattr(atom.aval, "shape", ()):
                reads.update(self._part(op, atom))
                continue
            reads.update(self._leaves(atom))
        return reads

    def _part(self, op: Any, atom: Any) -> dict[Any, float]:
        """What slicing ``op`` reads of ``atom``: the part it takes, of the buffer or of the
        buffers under a fused ``atom`` (each in proportion)."""
        whole = aval_bytes(atom.aval)
        taken = sum(aval_bytes(v.aval) for v in op.outputs)
        if not self.is_fused(atom):
            return {("part", id(op)): float(min(taken, whole))}
        share = min(1.0, taken / whole) if whole else 1.0
        return {leaf: size * share for leaf, size in self._leaves(atom).items()}

    def _independent(self, op: Any, kernel: set[int], start: int, budget: int = 64) -> bool:
        """Whether ``op`` depends on no op of ``kernel`` (whose first op is at ``start``)
        other than through that op's value computed inline (through fused values alone): it
        may join that kernel without a cycle. A value reached through a buffer or a scalar
        (a kernel's argument: a reduction's result, say) is a dependence. Searches at most
        ``budget`` ops back; past that, no."""
        stack = [(atom, True) for atom in op.inputs]
        seen: set[int] = set()
        while stack:
            atom, inline = stack.pop()
            producer = self._producer.get(id(atom))
            if producer is None:
                continue
            member = id(producer) in kernel
            shaped = bool(getattr(atom.aval, "shape", ()))
            inline = inline and (self.is_fused(atom) or (member and shaped))
            if member:
                if inline:
                    continue
                return False
            if id(producer) in seen or self._index.get(id(producer), -1) < start:
                continue
            seen.add(id(producer))
            if len(seen) > budget:
                return False
            stack += [(a, inline) for a in producer.inputs]
        return True

    def knows(self, op: Any) -> bool:
        """Whether ``op`` is one of the analysed program's (a copy made later is not)."""
        return id(op) in self._known

    def drops(self, op: Any) -> bool:
        """Whether XLA drops ``op``, an identity (:func:`is_identity`, :func:`sum_with_zeros`)."""
        return id(op) in self._dropped

    def is_fused(self, value: Any) -> bool:
        """Whether ``value`` gets no buffer (fused into its readers, or kept on chip)."""
        return id(value) in self._fused or id(value) in self._on_chip

    def kernel(self, op: Any) -> int | None:
        """The kernel ``op`` runs in, named by the ``id`` of its first op (``op``'s own where
        it launches one); None where its values are all computed inside their readers'."""
        return self._kernel_of.get(id(op))

    def launches(self, op: Any) -> bool:
        """Whether ``op`` launches a kernel: it writes a buffer and joins no earlier kernel
        (an op whose values are all fused runs inside its readers' kernels)."""
        if id(op) in self._joined or id(op) in self._dropped:
            return False
        return any(not self.is_fused(value) for value in op.outputs) or not op.outputs

    def _leaves(self, atom: Any) -> dict[Any, float]:
        """The buffers (a key each -> bytes) a reader of ``atom`` reads: ``atom`` itself, or
        through a fused value, what its producer reads."""
        key = id(atom)
        if key in self._on_chip or not getattr(atom.aval, "shape", ()):
            return {}  # kept in the kernel; or a scalar, passed as a kernel's argument
        if key not in self._fused:
            return {key: aval_bytes(atom.aval)}
        if key not in self._reads:
            self._reads[key] = self._operand_reads(self._producer[key])
        return self._reads[key]

    def bytes(self, op: Any) -> float:
        """Bytes ``op`` moves to and from memory: nothing where its values are computed
        inside their readers' kernels; else the buffers it reads (through its fused
        operands; nothing for what its kernel holds on chip, or another op of its kernel
        read already) and those it writes."""
        return self._bytes[id(op)]
