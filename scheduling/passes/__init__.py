"""Scheduling passes over the captured program and its dataflow graph.

``partition_search`` and ``partition_forward`` cut forward ranges into
pipelined chunks (rules in ``partition_rules``, layouts from
``batch_layout``, new ops from ``chunk_ops``); ``split_async`` turns
collectives into start/done pairs; ``schedule_dw`` packs dW work into the
backward all-to-all windows; ``exchange_regions`` recognises each MoE layer's
dispatch/combine all-to-all pair and ``decompose_exchange`` rewrites it into
per-source rounds or chunks (new ops from ``exchange_ops``); ``order``
produces the final order.
"""

from scheduling.passes.order import Schedule, order
from scheduling.passes.schedule_dw import Placement, schedule_dw
from scheduling.passes.split_async import split_async

__all__ = ["Placement", "Schedule", "order", "schedule_dw", "split_async"]
