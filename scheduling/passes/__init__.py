"""Scheduling passes: rewrites of the captured program and of its dataflow graph.

``partition_forward`` cuts forward ranges into pipelined chunks (layouts from
``scheduling.program.batch_layout``, rules in ``scheduling.program.partition_rules``,
new ops from ``chunk_ops``); ``split_async`` turns collectives into start/done pairs;
``schedule_dw`` packs dW work into the backward all-to-all windows;
``pair_microbatches`` runs microbatches' passes side by side; ``prefetch`` bounds how
early a weight gather starts; ``exchange_regions`` recognises each MoE layer's
dispatch/combine all-to-all pair and ``decompose_exchange`` rewrites it into
per-source rounds or chunks (new ops from ``exchange_ops``). Which rewrites a step
gets is the search's choice (:mod:`scheduling.search`); the order of the result is
the list scheduler's (:mod:`scheduling.order`).
"""

from scheduling.passes.schedule_dw import Placement, schedule_dw
from scheduling.passes.split_async import split_async, unsplit

__all__ = ["Placement", "schedule_dw", "split_async", "unsplit"]
