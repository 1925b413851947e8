"""Random token batches: the step's batch shape, ids below the vocabulary, sharded over
the token axes, different from batch to batch and the same for the same seed."""

import dataclasses

import jax
import numpy as np

from experiments.shared.token_batches import random_token_batches
from jaxmoe.config import ParallelConfig
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.presets import preset


def test_random_token_batches_are_shaped_and_placed_as_the_step_reads_them():
    config = preset("tiny")
    config = dataclasses.replace(config, parallel=ParallelConfig(data=2, expert=4))
    mesh = build_mesh(config.parallel, jax.devices())
    first, second = random_token_batches(config, mesh, 2)
    assert first.shape == (config.train.batch_size, config.model.seq_len + 1)
    assert first.dtype == np.int32 and first.sharding.spec == token_spec(mesh)
    values = np.asarray(first)
    assert values.min() >= 0 and values.max() < config.model.vocab_size
    assert not np.array_equal(values, np.asarray(second))
    again = random_token_batches(config, mesh, 1)[0]
    np.testing.assert_array_equal(values, np.asarray(again))
