"""The emitted step: a jit-compiled program that runs a schedule (``emit``) through a
transport (``transports``), its windows held in place on XLA:GPU (``pinning``, with
``xla_barriers``, ``xla_groups`` and ``xla_latencies``) and read back from the compiled
HLO (``hlo_windows``)."""
