"""Which passes the pair schedule runs side by side (every pass once, none alone, each
backward pass after its own forward pass), and how two chains are merged."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.passes import split_async
from scheduling.passes.pair_microbatches import merge_chains, pass_pairs
from scheduling.program.capture import Phase, capture
from scheduling.program.graph import Role
from tests.scheduling.toys import fixed_seconds, mesh_x, sds

F, B = Phase.FORWARD, Phase.BACKWARD


def test_two_and_four_microbatches():
    assert pass_pairs(1) == []
    assert pass_pairs(2) == [((0, F), (1, F)), ((0, B), (1, B))]
    assert pass_pairs(4) == [
        ((0, F), (1, F)),
        ((0, B), (2, F)),
        ((1, B), (3, F)),
        ((2, B), (3, B)),
    ]


@pytest.mark.parametrize("count", [2, 3, 5, 8])
def test_every_pass_once_and_after_its_forward(count):
    pairs = pass_pairs(count)
    passes = [p for pair in pairs for p in pair]
    assert len(passes) == len(set(passes)) == 2 * count
    assert set(passes) == {(i, phase) for i in range(count) for phase in (F, B)}
    at = {p: n for n, pair in enumerate(pairs) for p in pair}
    assert all(at[i, F] < at[i, B] for i in range(count))


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
    merged = merge_chains(graph, first, second, fixed_seconds({}, default=1.0))
    # tanh feeds its all-to-all after 1 s, exp's chain after 3 s: tanh goes first, so its
    # exchange runs while exp, cos and sin compute.
    assert merged == [by_name["tanh"], *first]
