"""What a run writes for people to read while it trains and after it stopped.

``metrics`` (``config.json`` and one ``metrics.jsonl`` row per step), ``tensorboard``
(the same rows as summaries, the configuration as text), ``profiler`` (a ``jax.profiler``
trace of chosen steps) and ``appends`` (each record on disk whole or not at all, which the
first two write through). The step and the loop write here; nothing here changes what a
step computes.
"""
