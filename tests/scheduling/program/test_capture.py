"""capture: inlining of call-like bodies, opaque control flow, phases, layers, specs, constants."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

import scheduling
from scheduling.program.capture import Constant, Phase, capture
from tests.scheduling.toys import (
    ROWS,
    TOY_IN_SPECS,
    TOY_OUT_SPECS,
    D,
    mesh_2x4,
    mesh_x,
    producer_ops,
    put,
    reference,
    sds,
    toy_program,
    toy_shapes,
    toy_step,
)

CALL_LIKE = (
    "jit",
    "pjit",
    "closed_call",
    "eval_jaxpr",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
)
ALL_AXES = ("data", "expert")


@jax.custom_vjp
def _double(x):
    return 2.0 * x


_double.defvjp(lambda x: (2.0 * x, None), lambda _, g: (2.0 * g,))


@jax.jit
def _relu_then_psum(h):
    with jax.named_scope("inner"):
        return jax.lax.psum(jax.nn.relu(h), ALL_AXES)


def _nested_forward_step(x):
    with jax.named_scope("layer_0"):
        y = jax.checkpoint(lambda a: _double(_relu_then_psum(a)))(x)
        return jax.jit(lambda z: jax.lax.all_to_all(z, "expert", 0, 0, tiled=True))(y)


def _nested_grad_step(w, x):
    def loss(w):
        with jax.named_scope("layer_0"):
            h = jax.checkpoint(lambda a: jax.nn.relu(jax.jit(jnp.dot)(a, w)))(x)
            h = jax.lax.all_to_all(h, "expert", 0, 0, tiled=True)
        return jnp.sum(_double(h) ** 2)

    g = jax.grad(loss)(w)
    return w - 0.1 * jax.lax.psum(g, ALL_AXES)


def _primitives(jaxpr) -> set[str]:
    """Every primitive name in ``jaxpr``, recursively through sub-jaxprs."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            subs = param if isinstance(param, tuple | list) else (param,)
            for sub in subs:
                if isinstance(sub, jcore.ClosedJaxpr):
                    names |= _primitives(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    names |= _primitives(sub)
    return names


def _raw_jaxpr(step, args, in_specs, out_specs, mesh):
    mapped = jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.make_jaxpr(mapped)(*args).jaxpr


def test_call_like_bodies_are_inlined_in_forward_step():
    mesh = mesh_2x4()
    args = (sds(mesh, (64, D), P(ALL_AXES)),)
    raw = _primitives(_raw_jaxpr(_nested_forward_step, args, P(ALL_AXES), P(ALL_AXES), mesh))
    # The test is only meaningful if the traced step really has these calls.
    assert {"jit", "custom_jvp_call", "custom_vjp_call"} <= raw
    assert raw & {"remat2", "checkpoint"}

    program = capture(
        _nested_forward_step, *args, mesh=mesh, in_specs=P(ALL_AXES), out_specs=P(ALL_AXES)
    )
    assert not [op for op in program.ops if op.primitive in CALL_LIKE]
    assert [op.primitive for op in program.collectives()] == ["psum", "all_to_all"]
    assert [op.primitive for op in program.ops] == ["max", "psum", "mul", "all_to_all"]
    psum = program.collectives()[0]
    assert psum.layer == "layer_0/inner"


def test_call_like_bodies_are_inlined_in_grad_step_with_remat():
    mesh = mesh_2x4()
    args = (sds(mesh, (D, D), P()), sds(mesh, (64, D), P(ALL_AXES)))
    in_specs, out_specs = (P(), P(ALL_AXES)), P()
    raw = _primitives(_raw_jaxpr(_nested_grad_step, args, in_specs, out_specs, mesh))
    assert raw & {"remat2", "checkpoint"}
    assert raw & {"jit", "pjit"}

    program = capture(_nested_grad_step, *args, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    assert not [op for op in program.ops if op.primitive in CALL_LIKE]
    kinds = [(op.primitive, op.phase) for op in program.collectives()]
    assert kinds == [
        ("all_to_all", Phase.FORWARD),
        ("all_to_all", Phase.BACKWARD),
        ("psum", Phase.OPTIMIZER),
    ]


def test_scan_is_one_opaque_op_and_scatter_add_is_not():
    mesh = mesh_x()

    def step(x):
        def body(carry, row):
            return carry + jax.lax.psum(row, "x"), None

        total, _ = jax.lax.scan(body, jnp.zeros(D), x)
        y = x.at[jnp.array([0, 2])].add(1.0)
        return y + total

    program = capture(
        step, sds(mesh, (64, D), P("x")), mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )
    scans = [op for op in program.ops if op.primitive == "scan"]
    assert len(scans) == 1
    assert scans[0].is_opaque
    scatters = [op for op in program.ops if op.primitive == "scatter-add"]
    assert len(scatters) == 1
    assert not scatters[0].is_opaque
    # The psum inside the scan stays inside it: it is not a top-level collective.
    assert program.collectives() == []
    assert [op for op in program.ops if op.is_opaque] == scans


def _op_at(program, atom):
    return producer_ops(program)[atom]


@pytest.mark.parametrize("reg", [False, True], ids=["two_params", "with_regulariser"])
def test_phases_of_toy_training_step(reg):
    program = toy_program(reg)
    a2a = [op for op in program.ops if op.primitive == "all_to_all"]
    assert [(op.phase, op.layer) for op in a2a] == [
        (Phase.FORWARD, "layer_0"),
        (Phase.FORWARD, "layer_1"),
        (Phase.BACKWARD, "layer_1"),
        (Phase.BACKWARD, "layer_0"),
    ]
    # The new parameters: sub(param, mul(lr, psum(grad))), all in the optimizer phase.
    grad_psums = []
    for atom in program.outputs[: 3 if reg else 2]:
        sub = _op_at(program, atom)
        assert sub.primitive == "sub"
        assert sub.phase is Phase.OPTIMIZER
        mul = _op_at(program, sub.inputs[1])
        assert mul.phase is Phase.OPTIMIZER
        psum = _op_at(program, mul.inputs[1])
        assert psum.primitive == "psum"
        grad_psums.append(psum)
    assert all(op.phase is Phase.OPTIMIZER for op in grad_psums)
    # No optimizer op before the backward pass, no backward op after the last optimizer op.
    phases = [op.phase for op in program.ops]
    first_backward = phases.index(Phase.BACKWARD)
    assert Phase.OPTIMIZER not in phases[:first_backward]
    # Layers carry no AD transform names.
    layers = {op.layer for op in program.ops}
    assert {"layer_0", "layer_1"} <= layers
    assert not [layer for layer in layers if "jvp" in layer or "transpose" in layer]
    forward_dots = [
        op.layer
        for op in program.ops
        if op.primitive == "dot_general" and op.phase is Phase.FORWARD
    ]
    assert forward_dots == ["layer_0", "layer_1"]
    backward_dots = [
        op.layer
        for op in program.ops
        if op.primitive == "dot_general" and op.phase is Phase.BACKWARD
    ]
    assert sorted(backward_dots) == ["layer_0", "layer_1", "layer_1"]


def test_layer_strips_ad_transforms_from_name_stack():
    program = toy_program()
    backward = [op for op in program.ops if op.primitive == "all_to_all"][2]
    assert backward.name_stack == "transpose(jvp(layer_1))"
    assert backward.layer == "layer_1"


def test_specs_and_trees_are_flat_per_leaf():
    program = toy_program()
    params_shapes, x_shape = toy_shapes()
    assert program.in_specs == (P(), P(), P("x"))
    assert program.out_specs == (P(), P(), P())
    assert program.in_tree == jax.tree.structure((params_shapes, x_shape))
    out = jax.eval_shape(
        reference(toy_step, mesh_x(), TOY_IN_SPECS, TOY_OUT_SPECS), params_shapes, x_shape
    )
    assert program.out_tree == jax.tree.structure(out)
    assert len(program.inputs) == program.in_tree.num_leaves == len(program.in_specs)
    assert len(program.outputs) == program.out_tree.num_leaves == len(program.out_specs)
    # Per-device shapes: x is sharded over the 8 devices of 'x'.
    assert [v.aval.shape for v in program.inputs] == [(D, D)] * 2 + [(ROWS, D)]


def test_in_specs_given_as_prefix_are_expanded_per_leaf():
    mesh = mesh_x()
    params_shapes, x_shape = toy_shapes()
    program = capture(
        toy_step, params_shapes, x_shape, mesh=mesh, in_specs=(P(), P("x")), out_specs=P()
    )
    assert program.in_specs == (P(), P(), P("x"))
    assert program.out_specs == (P(),) * 3


_TABLE = np.arange(D * D, dtype=np.float32).reshape(D, D) / 10.0
_ROWS_TO_BUMP = np.array([0, 3], dtype=np.int32)
_JNP_BIAS = jnp.linspace(-1.0, 1.0, D, dtype=jnp.float32)


def _step_with_constants(w, x):
    h = (x @ w) @ _TABLE + _JNP_BIAS
    h = h.at[_ROWS_TO_BUMP].add(1.0)
    h = jax.lax.all_to_all(h, "x", 0, 0, tiled=True)
    return w + 1.0, jax.lax.psum(jnp.sum(h), "x")


def test_closed_over_constants_become_constant_atoms_and_emit_correctly():
    mesh = mesh_x()
    in_specs, out_specs = (P(), P("x")), (P(), P())
    w = put(mesh, jnp.eye(D, dtype=jnp.float32) * 0.5, P())
    x = put(mesh, jnp.arange(64 * D, dtype=jnp.float32).reshape(64, D) / 100.0, P("x"))
    program = capture(_step_with_constants, w, x, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    assert len(program.inputs) == 2
    assert program.in_specs == (P(), P("x"))
    constants = [
        a.value for op in program.ops for a in op.inputs if isinstance(a, Constant) and a.aval.shape
    ]
    assert any(np.array_equal(np.asarray(c), _TABLE) for c in constants)
    assert any(np.array_equal(np.asarray(c), _ROWS_TO_BUMP) for c in constants)
    assert any(np.array_equal(np.asarray(c), np.asarray(_JNP_BIAS)) for c in constants)

    step, _ = scheduling.optimize(
        _step_with_constants,
        w,
        x,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        policy="async",
    )
    expected = reference(_step_with_constants, mesh, in_specs, out_specs)(w, x)
    got = step(w, x)
    chex.assert_trees_all_equal(got, expected)


@pytest.mark.parametrize("prevent_cse", [True, False], ids=["prevent_cse", "cse_allowed"])
def test_a_recomputation_stays_behind_its_barrier(prevent_cse):
    # JAX lowers a differentiated remat body with prevent_cse behind an optimization
    # barrier on its inputs; without it XLA merges the recomputation with the forward
    # values it repeats, and the emitted step would keep them alive after all.
    def step(w, x):
        recomputed = jax.checkpoint(jnp.tanh, prevent_cse=prevent_cse)
        return jax.grad(lambda w: jnp.sum(recomputed(x @ w)))(w)

    mesh = mesh_x()
    in_specs, out_specs = (P(), P("x")), P()
    w = put(mesh, jnp.eye(D, dtype=jnp.float32) * 0.5, P())
    x = put(mesh, jnp.arange(64 * D, dtype=jnp.float32).reshape(64, D) / 100.0, P("x"))
    program = capture(step, w, x, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    barriers = [op for op in program.ops if op.primitive == "optimization_barrier"]
    if not prevent_cse:
        assert barriers == []
        return
    (barrier,) = barriers
    _, recomputation = (op for op in program.ops if op.primitive == "tanh")
    assert barrier.phase is recomputation.phase is Phase.BACKWARD
    assert recomputation.inputs[0] in barrier.outputs

    emitted, _ = scheduling.optimize(
        step, w, x, mesh=mesh, in_specs=in_specs, out_specs=out_specs, policy="async"
    )
    assert "optimization_barrier" in emitted.lower(w, x).as_text()
    chex.assert_trees_all_equal(emitted(w, x), reference(step, mesh, in_specs, out_specs)(w, x))


def _named_grad_step(w, x):
    def loss(w):
        h = checkpoint_name(x @ w, "kept")
        return jnp.sum(jnp.tanh(h) ** 2)

    policy = jax.checkpoint_policies.save_only_these_names("kept")
    return jax.grad(jax.checkpoint(loss, policy=policy))(w)


def test_an_annotation_for_autodiff_is_no_op_of_the_program():
    # checkpoint_name's equations only tell a policy what to keep: once differentiated,
    # each is its operand, and the program's ops read the named value's producer.
    mesh = mesh_x()
    in_specs, out_specs = (P(), P("x")), P()
    w = put(mesh, jnp.eye(D, dtype=jnp.float32) * 0.5, P())
    x = put(mesh, jnp.arange(64 * D, dtype=jnp.float32).reshape(64, D) / 100.0, P("x"))
    raw = _primitives(_raw_jaxpr(_named_grad_step, (w, x), in_specs, out_specs, mesh))
    assert "name" in raw  # the traced step holds the annotation
    program = capture(_named_grad_step, w, x, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    assert "name" not in {op.primitive for op in program.ops}
    step, _ = scheduling.optimize(
        _named_grad_step, w, x, mesh=mesh, in_specs=in_specs, out_specs=out_specs, policy="async"
    )
    expected = reference(_named_grad_step, mesh, in_specs, out_specs)(w, x)
    chex.assert_trees_all_equal(step(w, x), expected)
