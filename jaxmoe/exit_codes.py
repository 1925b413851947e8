"""The exit statuses of ``jaxmoe train`` and ``jaxmoe launch``, in one place.

Kept free of JAX imports: the launcher reads them without starting JAX.
"""

DONE = 0
USAGE_ERROR = 2  # a bad flag, value or input file, refused before anything compiles
PEER_FAILURE = 3  # a step hung: a peer process has probably died
NONFINITE = 4  # a step's loss or gradient norm was not finite (train.on_nonfinite=stop)
IO_ERROR = 5  # the run's files (metrics, checkpoints) could not be written
# EX_TEMPFAIL of sysexits.h: stopped by a signal after a checkpoint; resume with --resume.
PREEMPTED = 75
