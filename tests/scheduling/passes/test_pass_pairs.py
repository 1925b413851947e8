"""In which order the pair schedule's passes join the two running side by side (every pass
once, each backward pass after its own forward pass), and how chains are merged."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.passes import split_async
from scheduling.passes.pair_microbatches import merge_chains, pass_order
from scheduling.program.capture import Phase, capture
from scheduling.program.graph import Role
from tests.scheduling.toys import fixed_seconds, mesh_x, sds

F, B = Phase.FORWARD, Phase.BACKWARD


def test_two_and_four_microbatches():
    assert pass_order(1) == []
    assert pass_order(2) == [(0, F), (1, F), (0, B), (1, B)]
    assert pass_order(4) == [(0, F), (1, F), (0, B), (2, F), (1, B), (3, F), (2, B), (3, B)]


@pytest.mark.parametrize("count", [2, 3, 5, 8])
def test_every_pass_once_after_those_it_waits_for(count):
    order = pass_order(count)
    assert len(order) == len(set(order)) == 2 * count
    assert set(order) == {(i, phase) for i in range(count) for phase in (F, B)}
    at = {p: n for n, p in enumerate(order)}
    assert all(at[i, F] < at[i, B] for i in range(count))
    # A forward pass waits for the backward pass three microbatches before it (its
    # gradients: scheduling.names.MICROBATCHES_IN_FLIGHT), which joins first.
    assert all(at[i - 3, B] < at[i, F] for i in range(3, count))


def _two_chains(x, y):
    # Chain a: three computations, then an all-to-all; chain b: one, then an all-to-all.
    a = jax.lax.all_to_all(jnp.sin(jnp.cos(jnp.exp(x))), "x", 0, 0, tiled=True)
    b = jax.lax.all_to_all(jnp.tanh(y), "x", 0, 0, tiled=True)
    return a * 2.0, b * 3.0


def test_the_merge_starts_the_chain_nearer_its_collective_first():
    mesh = mesh_x()
    program = capture(
        _two_chains,
        sds(mesh, (64, 4), P("x")),
        sds(mesh, (64, 4), P("x")),
        mesh=mesh,
        in_specs=(P("x"), P("x")),
        out_specs=(P("x"), P("x")),
    )
    graph = split_async(program)
    by_name = {n.op.primitive: n.id for n in graph.nodes if n.role is Role.COMPUTE}
    first = [by_name["exp"], by_name["cos"], by_name["sin"]]
    second = [by_name["tanh"]]
    merged = merge_chains(graph, [first, second], fixed_seconds({}, default=1.0))
    # tanh feeds its all-to-all after 1 s, exp's chain after 3 s: tanh goes first, so its
    # exchange runs while exp, cos and sin compute; then exp's chain runs alone.
    assert merged.order == [by_name["tanh"], *first]
    assert merged.alone == set(first)
