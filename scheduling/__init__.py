"""The scheduling layer: rewrites a whole per-device training step so that
collectives run asynchronously behind computation.

It works on jaxprs alone and knows nothing of Flax or of jaxmoe. A step goes
through four stages, each with its public API here (everything outside the
package uses these names only):

- **capture** a per-device step into one flat :class:`Program`
  (:mod:`scheduling.program`);
- **schedule** it under a :class:`SchedulePolicy` and a cost model: the graph with
  collectives as start/done pairs, partitioned and decomposed where it pays, and
  the order of its nodes (:func:`schedule`, a :class:`Schedule`);
- **emit** a jit-compiled step that runs the schedule through a transport
  (:mod:`scheduling.runtime`);
- **report** what was overlapped (:mod:`scheduling.reports`).

:func:`optimize` does all four. Research options (for measuring, for checking
exactness, a transport of one's own) are kept out of the policy, in
:class:`ExperimentalOptions`.

Layers. Each module imports only from its own subpackage and the layers before it
(``tests/test_structure.py`` checks it):

1. ``names``, ``profiles``, ``policy``: what a user chooses from, and the policy
   itself; no JAX, so that a configuration is checked before anything compiles;
2. ``program``: the captured program, its dataflow graph and analyses of it (batch
   layouts, partition rules, collective purposes), and the one adapter of JAX
   internals (``program/jax_adapter.py``);
3. ``costs``: what ops and collectives cost, and the two-stream simulator;
4. ``passes``: rewrites of the program and its graph (split into start/done,
   partition, decompose exchanges, pack dW, pair microbatches, prefetch);
5. ``order``: the scheduler core, the list scheduler that orders a graph's nodes;
6. ``search``: which rewrites a policy gets, each candidate scored on the whole
   step (:func:`schedule`, Lancet's partition search, COMET's exchange choice);
7. ``runtime``: the emitted step, its transports, and how its windows are held on
   XLA:GPU (read back from the compiled HLO);
8. ``reports``: the schedule report, measured traces and the costs they give;
9. ``optimize``: capture, schedule, emit, report.

Why this module reads as it does: importing any submodule runs this one first, and
a configuration imports the no-JAX names (:mod:`scheduling.names`,
:class:`SchedulePolicy`) without JAX. So the names below are imported only for type
checkers and readers (the ``TYPE_CHECKING`` block: go to definition from here), and
at run time each is loaded from the module named there on first use: the table
that does it is read from that same block, so there is one list of the public names.
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # 1. names, profiles, policy (no JAX)
    from scheduling.policy import (
        ExperimentalOptions,
        PolicyError,
        SchedulePolicy,
        check_policy_fields,
    )
    from scheduling.profiles import PROFILES, DeviceProfile

    # 2. program
    from scheduling.program.capture import Op, Phase, Program, Value, aval_bytes, capture
    from scheduling.program.collective_purpose import AxisRoles, collective_purposes
    from scheduling.program.graph import Graph, Role
    from scheduling.program.jax_adapter import host_callback, host_callback_available
    from scheduling.program.program_memo import ProgramMemo
    from scheduling.program.saved_values import saved_for_backward

    # 3. costs
    from scheduling.costs.cost_model import (
        FREE_PRIMITIVES,
        REDUCTIONS,
        CostModel,
        collective_wire_bytes,
        is_matmul,
        is_ragged_exchange,
        op_flops,
    )
    from scheduling.costs.fusion import (
        FUSIBLE,
        IN_PLACE,
        SLICING,
        Fusion,
        fuses_into_readers,
        sum_with_zeros,
        zero_values,
    )
    from scheduling.costs.link_model import CollectiveCurves, PiecewiseLinear
    from scheduling.costs.profiling import OpProfiler, ProfiledCostModel
    from scheduling.costs.simulate import Timeline, simulate

    # 4. passes
    from scheduling.passes.prefetch import gathers_in_flight_bytes, is_parameter_gather

    # 5. order
    from scheduling.order.list_scheduler import Order, peak_live_bytes

    # 6. search
    from scheduling.search.schedule import Schedule, batch_inputs, cost_model, schedule
    from scheduling.search.step_estimate import estimate, exposed_all_to_all, node_seconds

    # 7. runtime
    from scheduling.runtime.emit import ScheduledStep, emit, xla_gpu_flags
    from scheduling.runtime.hlo_windows import (
        AsyncPair,
        KeptWindows,
        async_pairs,
        broken_windows,
        kept_windows,
    )
    from scheduling.runtime.hlo_windows import windows as hlo_windows
    from scheduling.runtime.transports import Connector, Transport, XlaAsync
    from scheduling.runtime.transports import connect as connect_transport

    # 8. reports
    from scheduling.reports.describe import build_report
    from scheduling.reports.gantt import available as gantt_available
    from scheduling.reports.measured_trace import (
        MeasuredOps,
        find_trace_file,
        hlo_op_keys,
        read_trace,
        side_by_side,
    )
    from scheduling.reports.measured_trace import compare as compare_trace
    from scheduling.reports.measured_trace import key_of as equation_key
    from scheduling.reports.report import ScheduleReport
    from scheduling.reports.traced_costs import TracedCosts, traced_costs

    # 9. all of it
    from scheduling.optimize import optimize


def _public_names() -> dict[str, tuple[str, str]]:
    """Public name -> (its module, its name there), read from the ``TYPE_CHECKING`` block
    of this file."""
    tree = ast.parse(Path(__file__).read_text())
    (block,) = (
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
        if node.test.id == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name: (statement.module, alias.name)
        for statement in block.body
        if isinstance(statement, ast.ImportFrom) and statement.module
        for alias in statement.names
    }


_API = _public_names()
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'scheduling' has no attribute {name!r}")
    module, defined_as = _API[name]
    value = getattr(importlib.import_module(module), defined_as)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """This package, whose public names stay what the table says: importing the
    submodule ``scheduling.optimize`` would otherwise bind the name ``optimize`` to that
    module instead of the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
