"""Which rewrites a policy gets, each candidate scored on the whole step: the entry point
``schedule`` (a :class:`~scheduling.search.schedule.Schedule`), the whole-step estimate
(``step_estimate``), Lancet's partition dynamic programme (``partition_search``), the
joint choice of ranges and dW packing (``joint_choice``), and COMET's exchange choice
(``exchange_choice``)."""
