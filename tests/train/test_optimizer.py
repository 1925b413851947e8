"""AdamW's weight-decay mask and the learning-rate schedule's end points."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.config import ModelConfig, MoEConfig, TrainConfig
from jaxmoe.layers import GPTMoE
from jaxmoe.train.optimizer import _decay_mask, learning_rate_fn


def test_weights_are_decayed_and_biases_and_scales_are_not():
    # The mask reads the parameters' names and ranks: their shapes are enough.
    model = nnx.eval_shape(
        lambda: GPTMoE(
            ModelConfig(d_model=16, num_heads=2, num_layers=2, d_ff=32, seq_len=8),
            MoEConfig(num_experts=4),
            rngs=nnx.Rngs(0),
        )
    )
    mask = _decay_mask(nnx.to_pure_dict(nnx.state(model)))
    flat = {
        jax.tree_util.keystr(path): decayed
        for path, decayed in jax.tree_util.tree_leaves_with_path(mask)
    }
    experts = "['blocks'][1]['ffn']['experts']"
    assert flat[f"{experts}['w_in']"] and flat[f"{experts}['w_out']"]
    assert not flat[f"{experts}['b_in']"] and not flat[f"{experts}['b_out']"]  # [E, d]
    assert flat["['blocks'][0]['attention']['query']['kernel']"]
    assert not flat["['blocks'][0]['ffn']['up']['bias']"]
    assert not flat["['blocks'][0]['attention_norm']['scale']"]
    assert flat["['token_embed']['embedding']"] and flat["['position_embed']"]


def test_schedule_warms_up_then_ends_at_the_floor_on_the_last_step():
    train = TrainConfig(steps=50, warmup_steps=10, learning_rate=1e-3, min_lr_ratio=0.1)
    schedule = learning_rate_fn(train)
    assert 0 < schedule(0) < schedule(9) < schedule(10)
    np.testing.assert_allclose(schedule(10), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(schedule(train.steps - 1), 1e-4, rtol=1e-5)
    assert all(jnp.diff(schedule(jnp.arange(10, 50))) <= 0)  # elementwise: one call
