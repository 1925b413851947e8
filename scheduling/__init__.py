"""The scheduling layer: rewrites a whole per-device training step so that
collectives run asynchronously behind computation.

It works on jaxprs alone and knows nothing of Flax or of jaxmoe. The pipeline,
and the public API for each stage (everything outside the package uses these
names only):

- **capture** a per-device step into one flat :class:`Program`
  (:mod:`scheduling.program`);
- **plan** it under a :class:`SchedulePolicy` and a cost model: the graph with
  collectives as start/done pairs, partitioned and decomposed where it pays, and
  the order of its nodes (:mod:`scheduling.planning`, :mod:`scheduling.passes`);
- **estimate** a plan on the two-stream simulator (:mod:`scheduling.costs`);
- **emit** a jit-compiled step that runs the plan through a transport
  (:mod:`scheduling.runtime`);
- **report** what was overlapped (:mod:`scheduling.reports`).

:func:`optimize` does all five. The names a configuration chooses from (policies,
profiles, op costs, transports) are in :mod:`scheduling.names`, which imports no JAX;
so that importing this package stays as cheap, the API below is loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
_API = {
    # capture: the program
    "capture": "scheduling.program.capture",
    "Program": "scheduling.program.capture",
    "Op": "scheduling.program.capture",
    "Phase": "scheduling.program.capture",
    "Value": "scheduling.program.capture",
    "aval_bytes": "scheduling.program.capture",
    "Graph": "scheduling.program.graph",
    "Role": "scheduling.program.graph",
    "AxisRoles": "scheduling.program.collective_purpose",
    "collective_purposes": "scheduling.program.collective_purpose",
    "saved_for_backward": "scheduling.program.saved_values",
    # costs
    "CostModel": "scheduling.costs.cost_model",
    "op_flops": "scheduling.costs.cost_model",
    "collective_wire_bytes": "scheduling.costs.cost_model",
    "FREE_PRIMITIVES": "scheduling.costs.cost_model",
    "FUSIBLE": "scheduling.costs.cost_model",
    "DeviceProfile": "scheduling.costs.profiles",
    "PROFILES": "scheduling.costs.profiles",
    "CollectiveCurves": "scheduling.costs.link_model",
    "PiecewiseLinear": "scheduling.costs.link_model",
    "OpProfiler": "scheduling.costs.profiling",
    "ProfiledCostModel": "scheduling.costs.profiling",
    "simulate": "scheduling.costs.simulate",
    "Timeline": "scheduling.costs.simulate",
    "traced_costs": "scheduling.costs.traced_costs",
    "TracedCosts": "scheduling.costs.traced_costs",
    # plan
    "SchedulePolicy": "scheduling.planning.policy",
    "PolicyError": "scheduling.planning.policy",
    "check_policy_fields": "scheduling.planning.policy",
    "plan": "scheduling.planning.plan",
    "Plan": "scheduling.planning.plan",
    "cost_model": "scheduling.planning.plan",
    "batch_inputs": "scheduling.planning.plan",
    "peak_live_bytes": "scheduling.passes.order",
    "is_parameter_gather": "scheduling.passes.prefetch",
    "gathers_in_flight_bytes": "scheduling.passes.prefetch",
    # estimate
    "estimate": "scheduling.planning.step_estimate",
    "node_seconds": "scheduling.planning.step_estimate",
    "exposed_all_to_all": "scheduling.planning.step_estimate",
    # emit
    "emit": "scheduling.runtime.emit",
    "ScheduledStep": "scheduling.runtime.emit",
    "xla_gpu_flags": "scheduling.runtime.emit",
    "connect_transport": "scheduling.runtime.transports",
    "socket_applies": "scheduling.runtime.transports",
    "SocketTransport": "scheduling.runtime.socket_all_to_all",
    "SocketAllToAll": "scheduling.runtime.socket_all_to_all",
    "all_to_all_now": "scheduling.runtime.socket_all_to_all",
    "consume_token": "scheduling.runtime.socket_all_to_all",
    # report
    "build_report": "scheduling.reports.describe",
    "ScheduleReport": "scheduling.reports.report",
    "gantt_available": "scheduling.reports.gantt",
    "find_trace_file": "scheduling.reports.measured_trace",
    "read_trace": "scheduling.reports.measured_trace",
    "compare_trace": "scheduling.reports.measured_trace",
    "side_by_side": "scheduling.reports.measured_trace",
    "MeasuredOps": "scheduling.reports.measured_trace",
    "equation_key": "scheduling.reports.measured_trace",
    "hlo_op_keys": "scheduling.reports.measured_trace",
    "hlo_windows": "scheduling.reports.hlo_windows",
    "broken_windows": "scheduling.reports.hlo_windows",
    "async_pairs": "scheduling.reports.hlo_windows",
    "AsyncPair": "scheduling.reports.hlo_windows",
    "kept_windows": "scheduling.reports.hlo_windows",
    "KeptWindows": "scheduling.reports.hlo_windows",
    # all of it
    "optimize": "scheduling.pipeline",
}
# Where a public name differs from the name in its module.
_RENAMED = {
    "hlo_windows": "windows",
    "connect_transport": "connect",
    "gantt_available": "available",
    "compare_trace": "compare",
    "equation_key": "key_of",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'scheduling' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
