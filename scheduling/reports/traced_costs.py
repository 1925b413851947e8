"""Op costs from inside the compiled step: a profiler trace's times, given to graph nodes.

The op profiler (:mod:`scheduling.costs.profiling`) times each op alone; inside the
compiled step the same ops cost what XLA made of them (fused, laid out, on warm caches).
:func:`traced_costs` reads a ``jax.profiler`` trace of the compiled step
(:func:`scheduling.reports.measured_trace.read_trace`, with the compiled module's text)
and gives each node of a scheduled graph of the same step its measured seconds:

- **Computation.** :func:`scheduling.reports.measured_trace.attribute` groups the traced
  XLA ops with the scheduled keys (name stack, primitive) they hold; a row's seconds are
  shared among the graph's compute nodes of its keys in proportion to the cost model's
  estimates (evenly where those are all zero). Two more kinds of time are the compute
  stream's too, and are spread over every compute node in proportion to its traced
  seconds: XLA ops that name no scheduled op (copies and layout changes XLA adds;
  ``unattributed_s``, with the time of any collective the graph has no node for), and
  the step's time between ops, the runtime's own work from one
  op to the next (``between_ops_s``: the traced step, first op to last, less its ops).
- **Collectives: host work apart from the link.** A collective's traced time holds its
  waiting for the link and for its peers, which is what the simulator models, so it is not
  taken as the collective's cost. What the trace gives is the host work each collective
  puts on the compute stream (:attr:`TracedCosts.host`): a transport's start and done host
  callbacks for an all-to-all (``callback_scopes``: the two name scopes they run under,
  inside the all-to-all's own name stack, as the emulated cluster's socket transport
  does), their seconds per call given to the start and done nodes of that stack; and
  XLA's own collectives (which
  XLA may combine, so they are matched by kind, not by name), their seconds shared among
  the graph's other collectives in proportion to the bytes each puts on the wire. A
  callback or collective also waits for its peers: the host work alone is measured where
  communication is nearly free (the emulated cluster's unshaped link), and the link's own
  time comes from a link model (:func:`scheduling.costs.cost_model.collective_wire_bytes`
  over the calibrated rate).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from scheduling.costs.cost_model import collective_wire_bytes
from scheduling.program.graph import Graph, Node, Role
from scheduling.reports.measured_trace import Key, MeasuredOps, attribute, hlo_op_keys

# XLA's own collectives, by instruction name (``all-reduce.1``, ``all-gather-start.3``).
_XLA_COLLECTIVE = re.compile(
    r"^(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute)"
)


@dataclass(frozen=True)
class TracedCosts:
    """Seconds per graph node measured inside the compiled step (see the module)."""

    compute: dict[int, float]  # compute node -> seconds on the compute stream
    host: dict[int, float]  # collective node (start, done or unsplit) -> host seconds
    traced_step_s: float  # the traced step, first op to last
    unattributed_s: float  # seconds of XLA ops naming no scheduled op, spread over compute
    between_ops_s: float  # seconds of the traced step outside any op, spread over compute
    callbacks_s: float  # the transport callbacks' seconds (host work and waiting)
    xla_collectives_s: float  # XLA's collectives' seconds

    def seconds(self, link: Callable[[Node], float]) -> Callable[[Node], float]:
        """Node seconds for :func:`scheduling.costs.simulate.simulate`: compute nodes
        their traced seconds, collectives ``link`` (their time on the link)."""

        def node_seconds(node: Node) -> float:
            if node.is_collective:
                return 0.0 if node.role is Role.DONE else link(node)
            return self.compute.get(node.id, 0.0)

        return node_seconds

    def host_seconds(self, node: Node) -> float:
        return self.host.get(node.id, 0.0)


def traced_costs(
    graph: Graph,
    measured: MeasuredOps,
    hlo_text: str,
    estimate: Callable[[Node], float],
    axis_sizes: dict[str, int],
    callback_scopes: tuple[str, str] | None = None,
) -> TracedCosts:
    """Each node of ``graph`` its seconds in the traced step (``measured``, of the
    compiled module ``hlo_text``). ``estimate``: the cost model's seconds per node, which
    share a row's time among its nodes; ``axis_sizes``: the mesh's, for wire bytes;
    ``callback_scopes``: the name scopes of a transport's start and done callbacks for an
    all-to-all (None: the step has none)."""
    scopes = callback_scopes or ()
    callbacks: dict[str, defaultdict[str, float]] = {scope: defaultdict(float) for scope in scopes}
    xla_collectives = 0.0
    rest: dict[str, float] = {}
    keys = hlo_op_keys(hlo_text)
    for xla_op, seconds in measured.seconds.items():
        scope = _callback_scope(keys[xla_op].own, scopes) if xla_op in keys else None
        if scope is not None:
            callbacks[scope[0]][scope[1]] += seconds
        elif _XLA_COLLECTIVE.match(xla_op):
            xla_collectives += seconds
        else:
            rest[xla_op] = seconds

    host, served, unplaced = _callback_host_work(graph, callbacks, scopes)
    others = [
        node
        for node in graph.nodes
        if node.is_collective and node.role is not Role.DONE and node.id not in served
    ]
    wire = {node.id: collective_wire_bytes(node.op, axis_sizes) for node in others}
    total_wire = sum(wire.values())
    for node_id, size in wire.items():
        if size > 0:
            host[node_id] += xla_collectives * size / total_wire
    if total_wire == 0:
        unplaced += xla_collectives

    by_key: dict[Key, list[Node]] = defaultdict(list)
    for node in graph.nodes:
        if not node.is_collective:
            by_key[(node.op.name_stack, node.op.primitive)].append(node)
    estimates = {key: sum(estimate(node) for node in nodes) for key, nodes in by_key.items()}
    traced = MeasuredOps(measured.module, measured.steps, measured.devices, rest, 0.0)
    rows = attribute(traced, hlo_text, estimates)
    compute: dict[int, float] = {}
    for anchor, members in rows.members.items():
        nodes = [node for key in members for node in by_key[key]]
        _share(compute, nodes, rows.measured_seconds(traced, anchor), estimate)
    unattributed = sum(rows.unmatched_xla_ops.values()) + unplaced
    between = max(0.0, measured.step_seconds - sum(measured.seconds.values()))
    attributed = sum(compute.values())
    if attributed > 0:
        scale = 1 + (unattributed + between) / attributed
        compute = {node: seconds * scale for node, seconds in compute.items()}
    return TracedCosts(
        compute=compute,
        host=dict(host),
        traced_step_s=measured.step_seconds,
        unattributed_s=unattributed,
        between_ops_s=between,
        callbacks_s=sum(sum(stacks.values()) for stacks in callbacks.values()),
        xla_collectives_s=xla_collectives,
    )


def _callback_host_work(
    graph: Graph, callbacks: dict[str, defaultdict[str, float]], scopes: tuple[str, ...]
) -> tuple[defaultdict[int, float], set[int], float]:
    """The callbacks' seconds (per scope and name stack) on the all-to-all nodes of
    that stack: a split one's start or done, an unsplit one (started and waited for at
    once) both. Returns the host seconds per node, the nodes (and their partners) so
    served, and the seconds of stacks with no all-to-all node in ``graph``."""
    host: defaultdict[int, float] = defaultdict(float)
    served: set[int] = set()
    unplaced = 0.0
    if not scopes:
        return host, served, unplaced
    for scope, role in zip(scopes, (Role.START, Role.DONE), strict=True):
        for stack, seconds in callbacks[scope].items():
            nodes = [
                node
                for node in graph.nodes
                if node.op.primitive == "all_to_all"
                and node.op.name_stack == stack
                and node.role in (role, Role.COMPUTE)
            ]
            if not nodes:
                unplaced += seconds
            for node in nodes:
                host[node.id] += seconds / len(nodes)
                served |= {node.id, node.partner}
    served.discard(None)
    return host, served, unplaced


def _callback_scope(own: tuple[Key, ...], scopes: tuple[str, ...]) -> tuple[str, str] | None:
    """``(scope, the all-to-all's name stack)`` of a transport callback, else None."""
    for stack, _ in own:
        head, _, scope = stack.rpartition("/")
        if scope in scopes:
            return scope, head
    return None


def _share(into: dict[int, float], nodes: list[Node], seconds: float, estimate) -> None:
    """``seconds`` over ``nodes`` in proportion to their estimates (evenly if all zero)."""
    if not nodes:
        return
    weights = [estimate(node) for node in nodes]
    total = sum(weights)
    for node, weight in zip(nodes, weights, strict=True):
        into[node.id] = into.get(node.id, 0.0) + seconds * (
            weight / total if total > 0 else 1 / len(nodes)
        )
