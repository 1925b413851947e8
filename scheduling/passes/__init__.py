"""Scheduling passes over the dataflow graph: split collectives into start/done
pairs, pack dW work into backward all-to-all windows, and order the program."""

from scheduling.passes.order import Schedule, order
from scheduling.passes.schedule_dw import Placement, schedule_dw
from scheduling.passes.split_async import split_async

__all__ = ["Placement", "Schedule", "order", "schedule_dw", "split_async"]
