"""``schedule``: what a policy makes of a captured program, scored by a cost model.

The entry point of the search: from a :class:`~scheduling.program.capture.Program`,
a :class:`~scheduling.policy.SchedulePolicy` and a cost model, the :class:`Schedule`:
the graph (partitioned and decomposed where the policy chose to), the order of its
nodes with the dW placement, and what was chosen for each range and exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
from jax.sharding import Mesh

from scheduling import names
from scheduling.costs.cost_model import CostModel
from scheduling.costs.link_model import CollectiveCurves
from scheduling.costs.profiling import OpProfiler, ProfiledCostModel, is_local
from scheduling.costs.simulate import Timeline
from scheduling.order.list_scheduler import Order, order
from scheduling.passes import Placement, unsplit
from scheduling.policy import ExperimentalOptions, SchedulePolicy
from scheduling.program.batch_layout import analyze
from scheduling.program.capture import Program, Value
from scheduling.program.graph import Graph
from scheduling.search.exchange_choice import ExchangeChoice, best_comet, best_lancet_comet
from scheduling.search.joint_choice import best_lancet, best_partitioned
from scheduling.search.partition_search import CHUNK_COUNTS, PartitionChoice, expert_pipelines
from scheduling.search.step_estimate import StepEstimates, estimate


class Schedule(NamedTuple):
    """What a policy makes of a program: the graph and the order its nodes run in."""

    graph: Graph  # of the program as rewritten (partitioned ranges included)
    order: Order
    partitions: list[PartitionChoice]
    # The order simulated under the cost model that scored it (what
    # :func:`~scheduling.search.step_estimate.estimate` gives again).
    timeline: Timeline
    exchanges: Sequence[ExchangeChoice] = ()  # comet: every exchange, what was done with it


def cost_model(policy: SchedulePolicy, mesh: Mesh, program: Program | None = None) -> CostModel:
    """The policy's cost model: analytic or measured ops; profile or measured links. Given
    the ``program`` it prices, bound to it: on a fusing profile it prices that program's
    kernels (:meth:`~scheduling.costs.cost_model.CostModel.bound_to`)."""
    model = _cost_model(policy, mesh)
    return model if program is None else model.bound_to(program)


def _cost_model(policy: SchedulePolicy, mesh: Mesh) -> CostModel:
    curves = None if policy.link_curves is None else CollectiveCurves.load(policy.link_curves)
    if policy.op_costs == "measured":
        # Fake CPU devices share the host's cores: time each op on all of them at once.
        shared_cores = jax.default_backend() == "cpu" and is_local(mesh)
        profiler = OpProfiler(policy.op_cost_cache, mesh=mesh if shared_cores else None)
        return ProfiledCostModel(
            policy.device_profile, dict(mesh.shape), profiler, curves, mesh_device_ids(mesh)
        )
    return CostModel(policy.device_profile, dict(mesh.shape), curves, mesh_device_ids(mesh))


def mesh_device_ids(mesh: Mesh) -> list[int]:
    """The ids of the mesh's devices in mesh order (row-major over its axes).

    A device-less (abstract) mesh, as used to plan for more devices than this host
    has, numbers its devices in mesh order."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return list(range(mesh.size))
    return [device.id for device in mesh.devices.flat]


def batch_inputs(program: Program, batch_argnums: Sequence[int]) -> list[Value]:
    """The program inputs that are leaves of the arguments ``batch_argnums``."""
    leaves_per_arg = [child.num_leaves for child in program.in_tree.children()]
    values = []
    for arg in batch_argnums:
        if not 0 <= arg < len(leaves_per_arg):
            raise ValueError(f"batch_argnums: the step has no argument {arg}")
        offset = sum(leaves_per_arg[:arg])
        values.extend(program.inputs[offset : offset + leaves_per_arg[arg]])
    return values


def schedule(
    program: Program,
    policy: SchedulePolicy,
    cost: CostModel | None = None,
    batch_inputs: Sequence[Value] = (),
    experimental: ExperimentalOptions | None = None,
) -> Schedule:
    """What ``policy`` makes of ``program``: its graph, order and partitioned ranges.
    ``experimental``: the research options (:class:`~scheduling.policy.ExperimentalOptions`)."""
    cost = cost_model(policy, program.mesh) if cost is None else cost
    cost = cost.bound_to(program)
    experimental = experimental or ExperimentalOptions()
    experimental.check(policy)
    if policy.name == "none":
        graph = unsplit(program)
        nodes = order(graph, Placement(), policy.max_live_bytes_growth)
        return Schedule(graph, nodes, [], estimate(graph, nodes, cost))
    layouts = None
    if policy.name in names.PARTITIONING:
        if not batch_inputs:
            raise ValueError(
                f"schedule {policy.name!r} partitions along the batch: pass batch_argnums, "
                "the arguments whose leaves have the batch as their leading axis"
            )
        layouts = analyze(program, batch_inputs)
    estimates = StepEstimates(program, layouts, policy, cost, experimental.force_dw)
    counts = CHUNK_COUNTS if policy.partition_chunks is None else (policy.partition_chunks,)
    pack_dw = policy.name in names.PACKING_DW
    exchanges: list[ExchangeChoice] = []
    forced = experimental.exchange
    if policy.name == "comet":
        best, exchanges = best_comet(estimates, forced)
    elif policy.name == "lancet+comet":
        best, exchanges = best_lancet_comet(estimates, counts, forced)
    elif policy.name == "expert_pipeline":
        assert layouts is not None and policy.partition_chunks is not None
        pipelines = expert_pipelines(
            program, layouts, policy.partition_chunks, cost.seconds, cost.chunk_seconds
        )
        best = estimates(pipelines, pack_dw=False)
    elif policy.name == "lancet" and not experimental.partition_always:
        best = best_lancet(estimates, counts)
    elif policy.name in names.PARTITIONING:
        best = best_partitioned(estimates, counts, experimental.partition_always, pack_dw)
    else:
        best = estimates([], pack_dw)
    return Schedule(best.graph, best.order, best.partitions, best.timeline, exchanges)
