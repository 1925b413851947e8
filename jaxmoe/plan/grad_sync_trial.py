"""``train.grad_sync auto``'s trial: the algorithms the estimates cannot tell apart, timed.

The cost model ranks the algorithms (:mod:`jaxmoe.plan.grad_sync_choice`), but a step
estimated from op costs and collective curves is an estimate: on the emulated cluster
auto's steps were 15-30% below the measured ones, and two algorithms whose measured
steps differ by 4% came out equal. With ``train.grad_sync_trial_steps`` N > 0, every
algorithm whose estimated time to a loss is within ``train.grad_sync_trial_margin`` of
the best is compiled and run on the run's own mesh and batches (its first ``WARMUP`` + N,
from the run's seed): ``WARMUP`` untimed steps, then N timed. Its measured step (the
median; over processes, the slowest process's median, so that every process decides
alike) times its convergence cost replaces the estimate. The trial's states are thrown
away: the run starts from its own initial state.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxmoe.config import Config
from jaxmoe.data.batches import BatchSampler, put_on_mesh
from jaxmoe.data.mixture import load_mixture, run_batches
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import scheduled_train_step
from jaxmoe.train.state import init_train_state

WARMUP = 2  # untimed steps: the first runs the step's one-time work (connections, caches)


def trial_batches(config: Config) -> BatchSampler:
    """The run's training batches, as the training loop draws them."""
    return run_batches(config, load_mixture(config))[0]


def measured_step_seconds(config: Config, mesh: Mesh, name: str, batches: BatchSampler) -> float:
    """The median of ``config.train.grad_sync_trial_steps`` steps of ``config`` with
    ``train.grad_sync`` = ``name``, after ``WARMUP``; the slowest process's median."""
    with_algorithm = dataclasses.replace(
        config, train=dataclasses.replace(config.train, grad_sync=name)
    )
    run = resolve(with_algorithm, mesh)
    step = scheduled_train_step(run).compile()
    state = init_train_state(run)
    seconds = []
    for index in range(WARMUP + config.train.grad_sync_trial_steps):
        batch = put_on_mesh(batches, index, mesh)
        started = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        if index >= WARMUP:
            seconds.append(time.perf_counter() - started)
    median = np.float32(statistics.median(seconds))
    return float(np.max(multihost_utils.process_allgather(median)))
