"""Which devices form each group of a collective, and how the groups lie over nodes.

A collective over a tuple of mesh axes runs in one group per combination of
the other axes' coordinates. The mesh holds its devices in row-major order over
its axes; a device's node is its id over the profile's ``devices_per_node``
(nodes hold consecutive ids). The mesh's device order need not be the ids'
order, so the groups are read through it: :func:`group_spread` says how many
nodes the widest group spans, how many members share a node, and how heavily
the busiest node link is loaded, which is what the multi-node cost model needs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

IndexGroups = tuple[tuple[int, ...], ...] | None


def _strides(axis_sizes: dict[str, int]) -> dict[str, int]:
    strides, stride = {}, 1
    for name in reversed(list(axis_sizes)):
        strides[name] = stride
        stride *= axis_sizes[name]
    return strides


def group_members(axes: tuple[str, ...], axis_sizes: dict[str, int]) -> list[int]:
    """Mesh positions of the collective group over ``axes`` that holds position 0, in the
    order of the group's own (linear) index: the first axis of ``axes`` outermost."""
    strides = _strides(axis_sizes)
    members = [0]
    for axis in axes:
        if axis in axis_sizes:
            members = [m + k * strides[axis] for m in members for k in range(axis_sizes[axis])]
    return members


def collective_groups(
    axes: tuple[str, ...], axis_sizes: dict[str, int], index_groups: IndexGroups = None
) -> list[list[int]]:
    """Every group of the collective, as mesh positions in group-index order."""
    strides = _strides(axis_sizes)
    offsets = [0]
    for axis, size in axis_sizes.items():
        if axis not in axes:
            offsets = [o + k * strides[axis] for o in offsets for k in range(size)]
    base = group_members(axes, axis_sizes)
    groups = [[offset + m for m in base] for offset in offsets]
    if index_groups:
        groups = [[group[i] for i in sub] for group in groups for sub in index_groups]
    return groups


@dataclass(frozen=True)
class GroupSpread:
    """How the groups of one collective lie over nodes."""

    size: int  # members of a group
    nodes: int  # most nodes one group spans
    local: int  # most members of one group on one node
    # Most groups that cross nodes and have members on one node: they share its link.
    groups_sharing_a_node: int
    # Of one member's operand, the most that the members of one node send out of it
    # in an all-to-all (each member sends (size - c) / size of its operand off its node,
    # c its group's members on that node), summed over the node's members.
    all_to_all_node_load: float


def group_spread(
    axes: tuple[str, ...],
    axis_sizes: dict[str, int],
    devices_per_node: int,
    device_ids: Sequence[int] | None = None,
    index_groups: IndexGroups = None,
) -> GroupSpread:
    """The spread of the collective's groups over nodes of ``devices_per_node`` ids;
    ``device_ids`` are the mesh's devices in mesh order (default: ids in mesh order)."""
    total = math.prod(axis_sizes.values())
    ids = list(range(total)) if device_ids is None else list(device_ids)
    if len(ids) != total:
        raise ValueError(f"device_ids: {len(ids)} ids for a mesh of {total} devices")
    groups = collective_groups(axes, axis_sizes, index_groups)
    sharing: Counter[int] = Counter()
    load: Counter[int] = Counter()
    nodes = local = 1
    for group in groups:
        per_node = Counter(ids[position] // devices_per_node for position in group)
        nodes = max(nodes, len(per_node))
        local = max(local, max(per_node.values()))
        if len(per_node) > 1:
            sharing.update(per_node.keys())
        for node, count in per_node.items():
            load[node] += count * (len(group) - count) / len(group)
    return GroupSpread(
        size=len(groups[0]),
        nodes=nodes,
        local=local,
        groups_sharing_a_node=max(sharing.values(), default=0),
        all_to_all_node_load=max(load.values(), default=0.0),
    )


def members_per_node(
    axes: tuple[str, ...],
    axis_sizes: dict[str, int],
    per_node: int,
    index_groups: IndexGroups = None,
) -> int:
    """Members of a collective group over ``axes`` (the first of ``index_groups`` when
    given) that share a node with its first member; nodes hold ``per_node`` consecutive
    devices, in mesh order."""
    members = group_members(axes, axis_sizes)
    if index_groups:
        members = [members[i] for i in index_groups[0]]
    node = members[0] // per_node
    return sum(1 for m in members if m // per_node == node)
