"""The captured program and what is read off it, no scheduling yet: capture of a
per-device step into one flat program (``capture``), its dataflow graph with collectives
as start/done pairs (``graph``), the batch layouts and per-primitive partition rules
(``batch_layout``, ``partition_rules``, ``uniform_axes``), each collective's purpose
(``collective_purpose``), the values kept for the backward pass (``saved_values``), and
the one adapter of JAX internals (``jax_adapter``)."""
