"""The dependency bound (experiments/overlap_bound.py): what no order of a graph beats."""

import random

import pytest

from experiments import overlap_bound
from scheduling import Graph, simulate
from tests.scheduling.toys import toy_program


def test_a_chain_of_collectives_runs_the_compute_between_them_in_turn():
    """Compute 1 s, then a collective of 2 s, then 3 s of compute, a collective of 1 s and
    0.5 s of compute, each needing the one before; 0.5 s of compute needing nothing: the
    chain takes 7.5 s, more than the 5 s of compute or the 3 s of link work."""
    seconds = [1.0, 2.0, 3.0, 0.5, 1.0, 0.5]
    collective = [False, True, False, False, True, False]
    ancestors = [0, 0b1, 0b11, 0, 0b111, 0b10111]
    descendants = [0b110110, 0b110100, 0b110000, 0, 0b100000, 0]
    bound = overlap_bound.dependency_bound(ancestors, descendants, seconds, collective)
    assert bound == pytest.approx(7.5)
    # Without the collectives' chain the compute bounds it.
    assert overlap_bound.dependency_bound([0] * 6, [0] * 6, seconds, collective) == pytest.approx(
        5.0
    )


def _topological_orders(graph, count, seed=0):
    rng = random.Random(seed)
    for _ in range(count):
        waiting = [len(preds) for preds in graph.preds]
        ready = [node for node, left in enumerate(waiting) if not left]
        order = []
        while ready:
            node = ready.pop(rng.randrange(len(ready)))
            order.append(node)
            for succ in graph.succs[node]:
                waiting[succ] -= 1
                if not waiting[succ]:
                    ready.append(succ)
        yield order


@pytest.mark.parametrize("split", [False, True], ids=["synchronous", "start-done pairs"])
def test_no_order_of_a_step_is_shorter_than_its_bound(split):
    """The toy step's graph (its collectives run where they stand, or split into starts
    and dones that overlap), each op 1 to 3 ms and each collective 2 ms on the link: no
    order of it is shorter than the bound, and the bound is no less than the compute."""
    graph = Graph(toy_program(), lambda op: split)
    rng = random.Random(1)
    costs = {}
    for node in graph.nodes:
        if node.role.value == "done":
            costs[node.id] = 0.0
        else:
            costs[node.id] = 2e-3 if node.is_collective else rng.uniform(1e-3, 3e-3)
    seconds = [costs[node.id] for node in graph.nodes]
    collective = [node.is_collective for node in graph.nodes]
    bound = overlap_bound.dependency_bound(graph.ancestors, graph.descendants, seconds, collective)
    compute = sum(s for s, on_link in zip(seconds, collective, strict=True) if not on_link)
    assert bound >= compute
    steps = [
        simulate(graph, order, lambda node: costs[node.id]).step_seconds
        for order in _topological_orders(graph, 50)
    ]
    assert min(steps) >= bound - 1e-12
