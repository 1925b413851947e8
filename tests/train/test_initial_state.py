"""The initial state (``init_train_state``): a small model drawn on one device and laid out
after is the state drawn directly in its sharded layout, bit for bit, laid out as the run
says."""

import dataclasses

import chex
import jax

from jaxmoe.config import ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.state import init_train_state

from .runs import one_layer_config


def test_a_state_drawn_on_one_device_is_the_state_drawn_sharded():
    # ZeRO-3 shards the parameters over the data axis too, and the routers' expert biases
    # are model state beside them: both are laid out from the one device's draw.
    config = one_layer_config(zero=3)
    config = dataclasses.replace(
        config,
        parallel=ParallelConfig(data=2, expert=4),
        moe=dataclasses.replace(config.moe, expert_bias_rate=1e-3),
    )
    run = resolve(config, build_mesh(config.parallel))
    laid_out, sharded = init_train_state(run), init_train_state(run, one_device_bytes=0)
    assert laid_out.model_state is not None
    for state in (laid_out, sharded):
        assert jax.tree.map(lambda leaf: leaf.sharding.spec, state) == run.specs
    chex.assert_trees_all_equal(jax.device_get(laid_out), jax.device_get(sharded))
