"""The scheduler core: the list scheduler that orders a graph's nodes
(:mod:`scheduling.order.list_scheduler`). Below the search, which scores candidate
graphs in the orders made here; above the passes, whose dW placement, priorities and
prefetch bounds it honours."""
