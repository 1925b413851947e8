"""saved_for_backward: the forward values the backward pass reads, counted by hand on toys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from scheduling.program.capture import Phase, capture
from scheduling.program.saved_values import SavedValues, saved_for_backward
from tests.scheduling.toys import mesh_x, sds

ROWS, WIDTH, HIDDEN = 16, 8, 32
F32 = 4


def _program(loss):
    def step(w, x):
        return jax.grad(loss)(w, x)

    mesh = mesh_x()
    return capture(
        step,
        sds(mesh, (WIDTH, HIDDEN), P()),
        sds(mesh, (ROWS * 8, WIDTH), P("x")),
        mesh=mesh,
        in_specs=(P(), P("x")),
        out_specs=P(),
    )


def test_square_saves_one_activation():
    # d/dw sum((x @ w)^2) = x^T (2 x @ w): the backward pass reads one [rows, hidden]
    # value of the forward pass; x and w are inputs (the state's memory), not activations.
    saved = saved_for_backward(_program(lambda w, x: jnp.sum(jnp.square(x @ w))))
    assert (saved.count, saved.bytes) == (1, ROWS * HIDDEN * F32)


def test_tanh_saves_one_minus_its_output_squared():
    # JAX differentiates y = tanh(h) as g (1 - y^2), 1 - y^2 computed in the forward pass
    # (one_minus_square): the backward pass reads that one [rows, hidden] value.
    saved = saved_for_backward(_program(lambda w, x: jnp.sum(jnp.tanh(x @ w))))
    assert (saved.count, saved.bytes) == (1, ROWS * HIDDEN * F32)


def test_a_linear_loss_saves_nothing():
    # Its gradient is x^T @ ones: nothing of the forward pass is needed.
    assert saved_for_backward(_program(lambda w, x: jnp.sum(x @ w))) == SavedValues(0, 0)


def test_a_checkpointed_region_saves_its_input_and_is_recomputed_in_the_backward_pass():
    # Under jax.checkpoint the backward pass recomputes tanh from h = x @ w: it reads h
    # alone, not 1 - y^2 as above. The recomputation is inlined from the backward pass's
    # remat body, and must be labelled backward.
    program = _program(lambda w, x: jnp.sum(jax.checkpoint(jnp.tanh)(x @ w)))
    assert saved_for_backward(program) == SavedValues(1, ROWS * HIDDEN * F32)
    tanhs = [op for op in program.ops if op.primitive == "tanh"]
    assert [op.phase for op in tanhs] == [Phase.FORWARD, Phase.BACKWARD]


def test_only_what_the_chosen_ops_made_counts():
    # The gradient of tanh(h) h with h = x @ w reads h, y = tanh(h) and 1 - y^2: choosing
    # the matmul's results leaves h.
    program = _program(lambda w, x: jnp.sum(jnp.tanh(x @ w) * (x @ w)))
    assert saved_for_backward(program).count == 3
    chosen = saved_for_backward(program, made_by=lambda op: op.primitive == "dot_general")
    assert chosen == SavedValues(1, ROWS * HIDDEN * F32)
