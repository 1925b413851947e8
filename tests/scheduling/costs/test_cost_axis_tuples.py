"""Costs of collectives over tuples of mesh axes on profiles with nodes, by hand.

The toy mesh is ``data x expert x tensor_expert`` (2 x 2 x 2, the folded
layout of tests/scheduling/folding_toys); the profile puts 4 (or 2) consecutive
device ids on a node. Which members of a group share a node is read from the
mesh's device order, so the same collective costs more on a mesh whose order
puts its group on two nodes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from scheduling.costs.collective_groups import collective_groups, group_spread
from scheduling.costs.cost_model import CostModel
from scheduling.policy import SchedulePolicy
from scheduling.profiles import DeviceProfile
from scheduling.program.capture import aval_bytes, capture
from scheduling.search.schedule import cost_model
from tests.scheduling.folding_toys import FOLDED
from tests.scheduling.toys import sds

MESH = FOLDED.mesh
SIZES = dict(MESH.shape)  # data, expert, tensor_expert: 2 each
LINK, NODE_LINK, LATENCY, NODE_LATENCY = 1e6, 1e5, 1e-5, 2e-5
FLAT = DeviceProfile("flat", 1e9, 1e8, 1e-6, LINK, LATENCY)


def _nodes(per_node: int) -> DeviceProfile:
    return dataclasses.replace(
        FLAT,
        devices_per_node=per_node,
        node_link_bytes_per_s=NODE_LINK,
        node_link_latency_s=NODE_LATENCY,
    )


def _op(kind: str, axes: tuple[str, ...]):
    collectives = {
        "all_gather": lambda v: jax.lax.all_gather(v, axes, axis=1, tiled=True),
        "reduce_scatter": lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=1, tiled=True),
        "all_to_all": lambda v: jax.lax.all_to_all(v, axes, 1, 1, tiled=True),
        "psum": lambda v: jax.lax.psum(v, axes),
    }
    program = capture(
        collectives[kind],
        sds(MESH, (8 * 4, 16), P(FOLDED.axis_names)),
        mesh=MESH,
        in_specs=P(FOLDED.axis_names),
        out_specs=P(FOLDED.axis_names),
    )
    (op,) = program.collectives()
    return op


def _bytes(op):
    return sum(aval_bytes(a.aval) for a in op.inputs), sum(aval_bytes(v.aval) for v in op.outputs)


def test_groups_over_an_axis_tuple_follow_the_mesh_order():
    assert collective_groups(("tensor_expert",), SIZES) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert collective_groups(("expert", "tensor_expert"), SIZES) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert collective_groups(("data", "tensor_expert"), SIZES) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # The group's own index runs over the axes in the order the tuple names them.
    assert collective_groups(("tensor_expert", "data"), SIZES) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert collective_groups(("expert", "tensor_expert"), SIZES, ((0, 2), (1, 3))) == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
    ]


def test_group_spread_over_nodes():
    spread = group_spread(("data", "tensor_expert"), SIZES, 4)
    # {0, 1, 4, 5} and {2, 3, 6, 7}: two nodes each, two members on each, both groups
    # on each node, each of whose four members sends half its operand off the node.
    assert (spread.size, spread.nodes, spread.local) == (4, 2, 2)
    assert spread.groups_sharing_a_node == 2
    assert spread.all_to_all_node_load == pytest.approx(4 * 2 / 4)
    inside = group_spread(("expert", "tensor_expert"), SIZES, 4)
    assert (inside.nodes, inside.local, inside.groups_sharing_a_node) == (1, 4, 0)
    # Nodes of two: the expert group {0..3} spans two nodes, alone on each.
    split = group_spread(("expert", "tensor_expert"), SIZES, 2)
    assert (split.nodes, split.local, split.groups_sharing_a_node) == (2, 2, 1)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "psum"])
def test_hierarchical_collectives_over_an_axis_tuple_across_nodes(kind):
    op = _op(kind, ("data", "tensor_expert"))
    operand, result = _bytes(op)
    volume, passes = {
        "all_gather": (result, 1),
        "reduce_scatter": (operand, 1),
        "psum": (operand, 2),
    }[kind]
    # Group of 4 over 2 nodes (2 members each): inside the node, then across nodes,
    # where the two groups with members on each node share its link.
    expected = (
        LATENCY
        + NODE_LATENCY
        + passes * volume * (1 / 2) / LINK
        + 2 * passes * volume * (1 / 2) / NODE_LINK
    )
    assert CostModel(_nodes(4), SIZES).seconds(op) == pytest.approx(expected)


def test_all_to_all_over_an_axis_tuple_shares_the_node_link_between_groups():
    op = _op("all_to_all", ("data", "tensor_expert"))
    operand, _ = _bytes(op)
    # Each device keeps 1/4 on itself, sends 1/4 to its node neighbour and 1/2 off the
    # node; the node's four devices (two of each group) share its link.
    inside = operand * (1 / 4) / LINK
    across = 4 * operand * (1 / 2) / NODE_LINK
    expected = LATENCY + NODE_LATENCY + max(inside, across)
    assert CostModel(_nodes(4), SIZES).seconds(op) == pytest.approx(expected)


def test_collectives_inside_a_node_use_the_device_link():
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "psum"):
        op = _op(kind, ("expert", "tensor_expert"))
        assert CostModel(_nodes(4), SIZES).seconds(op) == pytest.approx(
            CostModel(FLAT, SIZES).seconds(op)
        )


def test_the_mesh_device_order_decides_which_members_cross_nodes():
    op = _op("all_gather", ("tensor_expert",))
    in_order = CostModel(_nodes(2), SIZES)
    # Tensor pairs on one node each in id order; interleaved, each pair spans two nodes.
    interleaved = [0, 2, 4, 6, 1, 3, 5, 7]
    crossing = CostModel(_nodes(2), SIZES, device_ids=interleaved)
    assert in_order.spread(op).nodes == 1
    assert crossing.spread(op).nodes == 2
    assert crossing.seconds(op) > in_order.seconds(op)
    _, result = _bytes(op)
    # Two members on two nodes, one each: the whole gather crosses, shared by 2 groups.
    expected = LATENCY + NODE_LATENCY + 2 * result * (1 / 2) / NODE_LINK
    assert crossing.seconds(op) == pytest.approx(expected)


def test_cost_model_reads_the_device_order_of_the_mesh():
    devices = np.asarray(jax.devices()[:8], dtype=object)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    mesh = Mesh(devices[order].reshape(2, 2, 2), FOLDED.axis_names)
    cost = cost_model(SchedulePolicy(name="async", profile=_nodes(2)), mesh)
    assert cost.device_ids == tuple(devices[i].id for i in order)
    assert cost.spread(_op("all_gather", ("tensor_expert",))).nodes == 2


def test_device_ids_must_cover_the_mesh():
    with pytest.raises(ValueError, match="device_ids"):
        group_spread(("data",), SIZES, 4, device_ids=[0, 1, 2])
