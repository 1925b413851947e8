"""In which order the pair schedule's passes join the two running side by side (every pass
once, each backward pass after its own forward pass), and how chains are merged."""

import random

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.passes import split_async
from scheduling.passes.pair_microbatches import _Ahead, _run_ahead, merge_chains, pass_order
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


def _graph(fn, count):
    mesh = mesh_x()
    program = capture(
        fn,
        *[sds(mesh, (64, 4), P("x"))] * count,
        mesh=mesh,
        in_specs=(P("x"),) * count,
        out_specs=(P("x"),) * count,
    )
    graph = split_async(program)
    return graph, {n.op.primitive: n.id for n in graph.nodes if n.role is Role.COMPUTE}


def _two_chains(x, y):
    # Chain a: three computations, then an all-to-all; chain b: one, then an all-to-all.
    a = jax.lax.all_to_all(jnp.sin(jnp.cos(jnp.exp(x))), "x", 0, 0, tiled=True)
    b = jax.lax.all_to_all(jnp.tanh(y), "x", 0, 0, tiled=True)
    return a * 2.0, b * 3.0


def test_the_merge_starts_the_chain_nearer_its_collective_first():
    graph, by_name = _graph(_two_chains, 2)
    first = [by_name["exp"], by_name["cos"], by_name["sin"]]
    second = [by_name["tanh"]]
    merged = merge_chains(graph, [first, second], fixed_seconds({}, default=1.0))
    # tanh feeds its all-to-all after 1 s, exp's chain after 3 s: tanh goes first, so its
    # exchange runs while exp, cos and sin compute; then exp's chain runs alone.
    assert merged.order == [by_name["tanh"], *first]
    assert merged.alone == set(first)


def _three_chains(x, y, z):
    # a: three computations, then an all-to-all; b: one, then an all-to-all; c: two.
    a = jax.lax.all_to_all(jnp.sin(jnp.cos(jnp.exp(x))), "x", 0, 0, tiled=True)
    b = jax.lax.all_to_all(jnp.tanh(y), "x", 0, 0, tiled=True)
    return a * 2.0, b * 3.0, jnp.sqrt(jnp.log(z))


def test_each_next_chain_joins_as_one_beside_it_ends():
    graph, by_name = _graph(_three_chains, 3)
    a = [by_name["exp"], by_name["cos"], by_name["sin"]]
    b, c = [by_name["tanh"]], [by_name["log"], by_name["sqrt"]]
    merged = merge_chains(graph, [a, b, c], fixed_seconds({}, default=1.0))
    # b, nearer its all-to-all, goes first and ends; c joins beside a, and two nodes from
    # its end (a: three from its all-to-all) goes on; a runs on alone.
    assert merged.order == [*b, *c, *a]
    assert merged.alone == set(a)


def _through_work_outside(x):
    a = jnp.sin(jnp.cos(jnp.exp(x)))
    return (jax.lax.all_to_all(jnp.tanh(a * 2.0), "x", 0, 0, tiled=True),)


def test_a_chain_waits_for_the_work_outside_the_chains_that_it_reads():
    graph, by_name = _graph(_through_work_outside, 1)
    a, b = [by_name["exp"], by_name["cos"], by_name["sin"]], [by_name["tanh"]]
    # tanh, nearer its all-to-all, reads what sin computes through a product in neither
    # chain: it waits for both.
    merged = merge_chains(graph, [a, b], fixed_seconds({}, default=1.0))
    assert merged.order == [*a, *b]


def _all_to_all(value):
    return jax.lax.all_to_all(value, "x", 0, 0, tiled=True)


def _chains_of_three_and_two_exchanges(x, y):
    a = jnp.tanh(_all_to_all(jnp.cos(_all_to_all(jnp.sin(_all_to_all(jnp.exp(x)))))))
    b = -jnp.abs(_all_to_all(jnp.log(_all_to_all(jnp.sqrt(y)))))
    return a, b


def test_a_run_ahead_puts_the_long_exchange_on_the_link_first():
    graph, by_name = _graph(_chains_of_three_and_two_exchanges, 2)
    a = [by_name[name] for name in ("exp", "sin", "cos", "tanh")]
    b = [by_name[name] for name in ("sqrt", "log", "abs", "neg")]

    def exchange_after(name):
        (start,) = (s for s in graph.succs[by_name[name]] if graph.nodes[s].role is Role.START)
        return start

    compute = dict(zip(a + b, [3.0, 1.0, 3.0, 2.0, 1.0, 1.0, 3.0, 2.0], strict=True))
    link = {exchange_after(n): s for n, s in [("exp", 4.0), ("sin", 1.0), ("cos", 4.0)]}
    link |= {exchange_after(n): s for n, s in [("sqrt", 1.0), ("log", 2.0)]}
    seconds = fixed_seconds(compute | link)
    # The rule alone starts b, a second from its exchange: a's four-second exchange then
    # goes on the link at 4 s, b's second one waits behind it, and the stream idles.
    alone = merge_chains(graph, [a, b], seconds, lookahead=0)
    assert alone.order == [b[0], a[0], b[1], a[1], b[2], b[3], a[2], a[3]]
    assert alone.end == 24.0
    # Run ahead, starting a ends sooner: its long exchanges lead the link.
    ahead = merge_chains(graph, [a, b], seconds)
    assert ahead.order == [a[0], b[0], a[1], b[1], a[2], b[2], b[3], a[3]]
    assert ahead.end == 19.0


def _random_chain(rng, first_node, first_start):
    """An ``_Ahead`` of ten to thirty nodes: some put a collective on the link, some wait
    for one the chain put there earlier, the rest do neither."""
    count = rng.randrange(10, 30)
    costs = [rng.choice([0.5, 1.0, 2.0]) for _ in range(count)]
    issues, waits, issued = [], [], []
    for _ in range(count):
        waits.append(tuple(rng.sample(issued, 1)) if issued and rng.random() < 0.3 else ())
        if rng.random() < 0.3:
            issues.append(((first_start + len(issued), rng.choice([1.0, 3.0])),))
            issued.append(issues[-1][0][0])
        else:
            issues.append(())
    to_collective, after = [0.0] * count, 0.0
    for index in reversed(range(count)):
        after = costs[index] + (0.0 if issues[index] else after)
        to_collective[index] = after
    nodes = list(range(first_node, first_node + count))
    return _Ahead.derived(nodes, costs, to_collective, waits, issues)


def _run_node_by_node(ahead, heads, first, now, link_free, lookahead):
    """What ``_run_ahead`` computes, one node at a time."""
    heads = list(heads)
    ends = [chain.horizon(head, lookahead) for chain, head in zip(ahead, heads, strict=True)]
    issued, pick = {}, first
    while True:
        options = [
            (max([now, *(issued.get(s, 0.0) for s in chain.waits[heads[c]])]),
             chain.to_collective[heads[c]], c)
            for c, chain in enumerate(ahead)
            if heads[c] < ends[c]
        ]  # fmt: skip
        if not options:
            return now
        ready, _, c = min(options) if pick is None else next(o for o in options if o[2] == pick)
        pick = None
        now = ready + ahead[c].seconds[heads[c]]
        for start, link in ahead[c].issues[heads[c]]:
            link_free = max(link_free, now) + link
            issued[start] = link_free
        heads[c] += 1


@pytest.mark.parametrize("seed", range(20))
def test_a_run_ahead_jumps_to_where_it_would_have_stepped(seed):
    rng = random.Random(seed)
    ahead = [_random_chain(rng, 0, 0), _random_chain(rng, 100, 100)]
    heads = [rng.randrange(len(chain.nodes)) for chain in ahead]
    for first in (0, 1):
        for lookahead in (1, 3, 6):
            expected = _run_node_by_node(ahead, heads, first, 2.0, 3.0, lookahead)
            found = _run_ahead(ahead, [0, 1], heads, first, 2.0, 3.0, {}, lookahead)
            assert found == pytest.approx(expected)
