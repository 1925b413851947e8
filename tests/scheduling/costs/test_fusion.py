"""fusion: which values XLA keeps out of memory, and the kernels the cost model prices
from it (bytes read through fused operands, one launch per kernel, one-kernel scopes,
the matmul efficiency curve)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.costs.cost_model import CostModel, op_flops
from scheduling.costs.fusion import Fusion, fuses_into_readers
from scheduling.names import ONE_KERNEL_SCOPE
from scheduling.passes.chunk_ops import chunk_aval, chunk_copy
from scheduling.profiles import PROFILES, DeviceProfile
from scheduling.program.capture import Value, aval_bytes, capture
from scheduling.program.partition_rules import Split, chunking
from tests.scheduling.toys import mesh_x, sds

ROWS, COLS = 64, 32
F32 = 4
FUSING = DeviceProfile(
    "fusing", 1e12, 1e9, 1e-6, 1e9, 1e-6, fused_elementwise=True, fused_kernels=True
)


def _program(step, *shapes, indices=()):
    """``step`` captured on float32 arguments of ``shapes`` (int32 at ``indices``)."""
    mesh = mesh_x()
    args = [
        sds(mesh, shape, P(), jnp.int32 if n in indices else jnp.float32)
        for n, shape in enumerate(shapes)
    ]
    return capture(step, *args, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P())


def _by_primitive(program):
    return {op.primitive: op for op in program.ops}


def test_an_elementwise_chain_is_one_kernel_with_its_reduction():
    # exp and mul fuse into the reduction: it reads x once and writes its row sums.
    program = _program(lambda x: (jnp.exp(x) * 2.0).sum(axis=1), (ROWS, COLS))
    fusion = Fusion(program.ops, program.outputs)
    ops = _by_primitive(program)
    for name in ("exp", "mul"):
        assert not fusion.launches(ops[name]) and fusion.bytes(ops[name]) == 0
    assert fusion.launches(ops["reduce_sum"])
    assert fusion.bytes(ops["reduce_sum"]) == (ROWS * COLS + ROWS) * F32
    cost = CostModel(FUSING, {"x": 8})
    bound = cost.bound_to(program)
    total = sum(bound.seconds(op) for op in program.ops)
    unfused = sum(cost.seconds(op) for op in program.ops)
    # One launch and one pass over x, against three of each.
    assert total == pytest.approx(
        FUSING.op_overhead_s + (ROWS * COLS + ROWS) * F32 / FUSING.memory_bytes_per_s,
        rel=0.05,
    )
    assert unfused > 2.5 * total


def test_a_value_a_matmul_reads_gets_a_buffer():
    program = _program(lambda x, w: jnp.tanh(x * 3.0) @ w, (ROWS, COLS), (COLS, COLS))
    fusion = Fusion(program.ops, program.outputs)
    ops = _by_primitive(program)
    # mul fuses into tanh, whose value the product reads from memory.
    assert not fusion.launches(ops["mul"])
    assert fusion.launches(ops["tanh"])
    assert fusion.bytes(ops["tanh"]) == 2 * ROWS * COLS * F32
    dot = ops["dot_general"]
    assert fusion.bytes(dot) == (ROWS * COLS + COLS * COLS + ROWS * COLS) * F32


def test_a_chunk_copy_is_fused_as_the_op_it_copies():
    """The forward partition's search prices chunk copies before their program exists:
    each as its original is fused (a fused op's copy moves nothing and launches nothing),
    its traffic scaled by what the copy reads and writes (the weight whole, half the rows)."""
    program = _program(lambda x, w: jnp.tanh(x * 3.0) @ w, (ROWS, COLS), (COLS, COLS))
    bound = CostModel(FUSING, {"x": 8}).bound_to(program)
    ops = _by_primitive(program)

    def half(op):
        how = chunking(op, [Split(0)] + [None] * (len(op.inputs) - 1), [frozenset()] * 2)
        inputs = [
            Value(chunk_aval(a.aval, 0, 2)) if cut is not None else a
            for a, cut in zip(op.inputs, how.inputs, strict=True)
        ]
        return chunk_copy(op, how, 2, inputs)

    mul, dot = ops["mul"], ops["dot_general"]
    assert bound.chunk_seconds(mul, half(mul)) == pytest.approx(bound.arithmetic_seconds(half(mul)))
    assert bound.seconds(half(mul)) > FUSING.op_overhead_s  # unknown to the fusion: a kernel
    whole = (ROWS * COLS + COLS * COLS + ROWS * COLS) * F32
    part = (ROWS * COLS // 2 + COLS * COLS + ROWS * COLS // 2) * F32
    assert bound.chunk_seconds(dot, half(dot)) == pytest.approx(
        max(bound.arithmetic_seconds(half(dot)), part / FUSING.memory_bytes_per_s)
        + FUSING.op_overhead_s
    )
    assert part < whole


def test_an_expensive_value_read_twice_is_computed_once():
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert fuses_into_readers("exp", bf16, ["add"])
    assert not fuses_into_readers("exp", bf16, ["add", "mul"])
    assert not fuses_into_readers("log", f32, ["add", "mul"])
    assert fuses_into_readers("mul", bf16, ["add", "sub"])  # cheap: repeated in each reader
    assert not fuses_into_readers("mul", f32, ["dot_general"])


def test_a_float32_exponential_is_repeated_in_each_reader():
    """XLA:GPU computes exp, div, sqrt and rsqrt of float32 or float16 in an instruction or
    two: a softmax's exponential is repeated in its sum and in the backward pass."""
    assert fuses_into_readers("exp", jnp.float32, ["reduce_sum", "mul"])
    assert fuses_into_readers("div", jnp.float16, ["add", "mul"])

    def softmax_grad(x):
        return jax.grad(lambda x: jnp.sum(jax.nn.softmax(x) * x))(x)

    program = _program(softmax_grad, (ROWS, COLS))
    fusion = Fusion(program.ops, program.outputs)
    exps = [op for op in program.ops if op.primitive == "exp"]
    assert exps and all(fusion.is_fused(op.outputs[0]) for op in exps)


def test_a_one_kernel_scope_keeps_its_values_on_chip():
    def step(x, w):
        with jax.named_scope(ONE_KERNEL_SCOPE):
            scores = jnp.exp(x @ w)
            return (scores / scores.sum(axis=1, keepdims=True)) @ w.T

    program = _program(step, (ROWS, COLS), (COLS, COLS))
    kept = Fusion(program.ops, program.outputs, kernels=True)
    loose = Fusion(program.ops, program.outputs, kernels=False)
    inputs = (ROWS * COLS + COLS * COLS) * F32
    output = ROWS * COLS * F32
    # In one kernel: the operands read (by each product) and the result written, nothing
    # in between.
    kernel_bytes = sum(kept.bytes(op) for op in program.ops)
    assert kernel_bytes <= 2 * inputs + output
    assert sum(loose.bytes(op) for op in program.ops) > kernel_bytes + 2 * output
    # A profile without fused kernels prices the ops as XLA fuses them.
    plain = dataclasses.replace(FUSING, fused_kernels=False)
    bound = CostModel(FUSING, {"x": 8}).bound_to(program)
    unbound = CostModel(plain, {"x": 8}).bound_to(program)
    assert sum(map(bound.seconds, program.ops)) < sum(map(unbound.seconds, program.ops))


def test_a_scan_in_one_kernel_moves_its_operands_once():
    def step(x, w):
        with jax.named_scope(ONE_KERNEL_SCOPE):
            out, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=8)
        return out

    program = _program(step, (ROWS, COLS), (COLS, COLS))
    scan = _by_primitive(program)["scan"]
    bound = CostModel(FUSING, {"x": 8}).bound_to(program)
    moved = sum(aval_bytes(a.aval) for a in scan.inputs) + aval_bytes(scan.outputs[0].aval)
    assert bound.bytes_moved(scan) == moved
    plain = CostModel(dataclasses.replace(FUSING, fused_kernels=False), {"x": 8})
    assert plain.bound_to(program).bytes_moved(scan) >= 8 * moved  # every trip's carry


def test_ops_a_pass_made_later_are_priced_alone():
    program = _program(lambda x: (jnp.exp(x) * 2.0).sum(axis=1), (ROWS, COLS))
    exp = _by_primitive(program)["exp"]
    copy = dataclasses.replace(exp)  # a new op: not in the bound program
    bound = CostModel(FUSING, {"x": 8}).bound_to(program)
    assert bound.bytes_moved(exp) == 0
    assert bound.bytes_moved(copy) == 2 * ROWS * COLS * F32


def test_matmuls_run_at_the_profiles_efficiency_curve():
    curve = dataclasses.replace(FUSING, matmul_efficiency=((1e6, 0.5), (1e10, 0.9)))
    assert curve.matmul_fraction(1e3) == 0.5
    assert curve.matmul_fraction(1e8) == pytest.approx(0.7)  # halfway in log FLOPs
    assert curve.matmul_fraction(1e12) == 0.9
    program = _program(lambda x, w: x @ w, (ROWS, COLS), (COLS, COLS))
    dot = _by_primitive(program)["dot_general"]
    flops = op_flops(dot)
    assert CostModel(curve, {"x": 8}).arithmetic_seconds(dot) == pytest.approx(
        flops / (FUSING.flops_per_s * curve.matmul_fraction(flops))
    )
    with pytest.raises(ValueError, match="matmul_efficiency"):
        dataclasses.replace(FUSING, matmul_efficiency=((1e6, 1.5),))
    h100 = PROFILES["h100-8x-nvlink-3200g"]
    assert h100.matmul_fraction(2 * 8192**3) == 0.79 and h100.fused_kernels


def test_an_optimizer_update_is_one_kernel():
    # Adam's moments and the new parameters: one pass over g, m, v and p, one launch.
    def update(g, m, v, p):
        m2 = 0.9 * m + 0.1 * g
        v2 = 0.99 * v + 0.01 * g * g
        return m2, v2, p - 0.01 * m2 / (jnp.sqrt(v2) + 1e-8)

    mesh = mesh_x()
    args = [sds(mesh, (ROWS, COLS), P()) for _ in range(4)]
    program = capture(update, *args, mesh=mesh, in_specs=(P(),) * 4, out_specs=(P(),) * 3)
    fusion = Fusion(program.ops, program.outputs)
    array = ROWS * COLS * F32
    assert sum(fusion.bytes(op) for op in program.ops) == 7 * array  # 4 read, 3 written
    assert sum(fusion.launches(op) for op in program.ops) == 1


def test_a_reader_that_needs_a_kernels_reduction_does_not_join_it():
    # Clipping: the update reads g scaled by a scalar made from g's sum of squares. Both
    # read g, but the update waits for the sum: two kernels, g read by each.
    def clipped(g, m):
        scale = jnp.minimum(1.0, 1.0 / jnp.sqrt((g * g).sum()))
        return 0.9 * m + 0.1 * (g * scale)

    program = _program(clipped, (ROWS, COLS), (ROWS, COLS))
    fusion = Fusion(program.ops, program.outputs)
    ops = _by_primitive(program)
    assert fusion.kernel(ops["add"]) != fusion.kernel(ops["reduce_sum"])
    array = ROWS * COLS * F32
    assert fusion.bytes(ops["add"]) == 3 * array  # g and m read, the new m written


def test_only_ops_of_one_loop_share_a_kernel():
    # r's sum loops over ROWS elements, the scaled x over ROWS * COLS: both read r, but XLA
    # gives them a kernel each. The row sums of x loop over x as its scaling does: one.
    def step(r, x):
        return r.sum(), x * r[:, None], (x * 2.0).sum(axis=1)

    program = _program(step, (ROWS,), (ROWS, COLS))
    fusion = Fusion(program.ops, program.outputs)
    [total, rows] = [op for op in program.ops if op.primitive == "reduce_sum"]
    [scaled, doubled] = [op for op in program.ops if op.primitive == "mul"]
    assert fusion.kernel(scaled) != fusion.kernel(total)
    assert fusion.kernel(rows) == fusion.kernel(scaled)  # both read x, both loop over it
    assert not fusion.launches(doubled)  # fused into the row sums


def test_slices_fused_into_their_reader_read_their_parts():
    # A gated activation's two halves, sliced from one buffer: one kernel reads each half
    # once; a quarter of it, a quarter.
    halves = _program(lambda x: (x[:, : COLS // 2] * x[:, COLS // 2 :]).sum(axis=1), (ROWS, COLS))
    fusion = Fusion(halves.ops, halves.outputs)
    ops = [op for op in halves.ops if op.primitive == "slice"]
    assert len(ops) == 2 and not any(fusion.launches(op) or fusion.bytes(op) for op in ops)
    assert sum(fusion.bytes(op) for op in halves.ops) == (ROWS * COLS + ROWS) * F32
    quarter = _program(lambda x: (x[:, : COLS // 4] * 2.0).sum(axis=1), (ROWS, COLS))
    fusion = Fusion(quarter.ops, quarter.outputs)
    assert sum(fusion.bytes(op) for op in quarter.ops) == (ROWS * COLS // 4 + ROWS) * F32
    # A gather reads the rows it takes, fused or not.
    rows = _program(
        lambda t, i: jnp.take(t, i[:, 0], axis=0) @ t.T, (ROWS, COLS), (8, 1), indices=(1,)
    )
    gather = _by_primitive(rows)["gather"]
    table, taken = ROWS * COLS * F32, 8 * COLS * F32
    assert Fusion(rows.ops, rows.outputs).bytes(gather) < table
    assert CostModel(FUSING, {"x": 8}).bytes_moved(gather) < table + taken


def test_an_update_in_place_moves_its_region():
    def accumulate(stack, g, i):
        row = jax.lax.dynamic_slice_in_dim(stack, i[0], 1)
        return jax.lax.dynamic_update_slice_in_dim(stack, row + jnp.tanh(g), i[0], 0)

    program = _program(accumulate, (ROWS, COLS), (1, COLS), (1,), indices=(2,))
    fusion = Fusion(program.ops, program.outputs)
    row = COLS * F32
    # Reads the row and the gradient, writes the row: the stack is not copied.
    assert sum(fusion.bytes(op) for op in program.ops) == 3 * row
    assert sum(fusion.launches(op) for op in program.ops) == 1
    # A scatter-add reads and writes the rows it adds to, and reads its updates.
    added = _program(
        lambda t, u, i: t.at[i[:, 0]].add(u), (ROWS, COLS), (8, COLS), (8, 1), indices=(2,)
    )
    scatter = _by_primitive(added)["scatter-add"]
    indices = 8 * 4
    assert Fusion(added.ops, added.outputs).bytes(scatter) == 3 * 8 * COLS * F32 + indices
    # Into a buffer the kernel itself computes (zeros), there is none to update: it writes
    # the whole result.
    fresh = _program(
        lambda g, i: jax.lax.dynamic_update_slice_in_dim(jnp.zeros((ROWS, COLS)), g, i[0], 0),
        (1, COLS),
        (1,),
        indices=(1,),
    )
    fusion = Fusion(fresh.ops, fresh.outputs)
    assert sum(fusion.bytes(op) for op in fresh.ops) == row + ROWS * COLS * F32


def test_a_rounding_to_the_values_own_precision_is_dropped():
    def step(x):
        kept = jax.lax.reduce_precision(x.astype(jnp.bfloat16), exponent_bits=8, mantissa_bits=7)
        rounded = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
        return kept @ kept.T, rounded @ rounded.T

    mesh = mesh_x()
    program = capture(
        step, sds(mesh, (ROWS, COLS), P()), mesh=mesh, in_specs=(P(),), out_specs=(P(), P())
    )
    cost = CostModel(FUSING, {"x": 8})
    bound = cost.bound_to(program)
    kept, rounded = [op for op in program.ops if op.primitive == "reduce_precision"]
    for model in (cost, bound):  # bf16 to bf16: nothing; f32 to bf16's precision: a kernel
        assert model.seconds(kept) == 0 and not model.launches(kept)
        assert model.seconds(rounded) > 0 and model.launches(rounded)
    assert not bound.fusion.launches(kept)


def test_a_sum_with_zeros_is_dropped():
    """The gradient of an input a function does not read is zeros (JAX broadcasts a literal
    zero); adding it to a running sum is the sum itself to XLA's simplifier: no kernel, in
    the time model and in what gets a buffer. A sum of two values is a kernel."""

    def step(total, x):
        grads = jax.grad(lambda p: jnp.sum(p["used"] ** 2))({"used": x, "unused": x})
        return total + grads["unused"], total + grads["used"]

    mesh = mesh_x()
    shape = sds(mesh, (ROWS, COLS), P())
    program = capture(step, shape, shape, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()))
    producer = {id(value): op for op in program.ops for value in op.outputs}
    with_zeros, with_gradient = (producer[id(value)] for value in program.outputs)
    assert with_zeros.primitive == with_gradient.primitive == "add"
    bound = CostModel(FUSING, {"x": 8}).bound_to(program)
    assert bound.fusion.drops(with_zeros) and not bound.fusion.drops(with_gradient)
    assert bound.seconds(with_zeros) == 0 and not bound.launches(with_zeros)
    assert bound.seconds(with_gradient) > 0 and bound.bytes_moved(with_gradient) > 0
