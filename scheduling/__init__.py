"""The scheduling layer: rewrites a whole per-device training step so that
collectives run asynchronously behind computation.

It works on jaxprs alone and knows nothing of Flax or of jaxmoe:
``capture`` traces the step to one flat per-device program, ``graph`` makes
it a dataflow graph with collectives as start/done pairs, ``passes`` cut
forward ranges into pipelined chunks and place and order the work, ``emit``
rebuilds a jit-compiled step, and ``report`` says what was done. Entry point: :func:`optimize`.
"""

from scheduling.capture import Program, capture
from scheduling.collective_purpose import AxisRoles
from scheduling.cost import PROFILES, CostModel, DeviceProfile
from scheduling.emit import ScheduledStep, xla_gpu_flags
from scheduling.link_model import CollectiveCurves
from scheduling.optimize import optimize, plan
from scheduling.policy import POLICIES, SchedulePolicy
from scheduling.report import ScheduleReport

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
