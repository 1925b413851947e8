"""The scheduling layer: rewrites a whole per-device training step so that
collectives run asynchronously behind computation.

It works on jaxprs alone and knows nothing of Flax or of jaxmoe:
``capture`` traces the step to one flat per-device program, ``graph`` makes
it a dataflow graph with collectives as start/done pairs, ``passes`` cut
forward ranges into pipelined chunks and place and order the work, ``emit``
rebuilds a jit-compiled step, and ``report`` says what was done. Entry point: :func:`optimize`.
"""

from scheduling.costs.cost_model import CostModel
from scheduling.costs.link_model import CollectiveCurves
from scheduling.costs.profiles import PROFILES, DeviceProfile
from scheduling.optimize import optimize, plan
from scheduling.planning.policy import POLICIES, SchedulePolicy
from scheduling.program.capture import Program, capture
from scheduling.program.collective_purpose import AxisRoles
from scheduling.reports.report import ScheduleReport
from scheduling.runtime.emit import ScheduledStep, xla_gpu_flags

__all__ = [
    "POLICIES",
    "PROFILES",
    "AxisRoles",
    "CollectiveCurves",
    "CostModel",
    "DeviceProfile",
    "Program",
    "SchedulePolicy",
    "ScheduleReport",
    "ScheduledStep",
    "capture",
    "optimize",
    "plan",
    "xla_gpu_flags",
]
