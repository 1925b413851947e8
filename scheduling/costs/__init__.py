"""What ops and collectives cost, and the step on two streams: the cost model
(``cost_model``, on a device profile of :mod:`scheduling.profiles`), measured op costs
(``profiling``), measured collective curves (``link_model``), how collective groups span
nodes (``collective_groups``), and the two-stream simulator (``simulate``)."""
