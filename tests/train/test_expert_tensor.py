"""Expert-tensor parallelism and the all_gather dispatcher train what the unfolded layout
trains.

Every mapping runs the same 3 steps (same seed, same batches) and is compared with
``parallel.data=2, parallel.expert=4`` and the all_to_all dispatcher. Routing groups are
sequences, so the same assignments are kept and dropped everywhere (compared exactly);
what differs is the order of float32 sums (hidden slices summed by a reduce-scatter,
gradients reduced over other mesh axes), a few ulps of each gradient. AdamW turns a
gradient ``g`` into an update of about ``lr * g / |g|``, so where a gradient element is
itself round-off (it cancels) a few ulps of it move the update by much more than a few
ulps of the parameter. Hence the tolerance on parameters is absolute and stated in
updates: ``lr / 1000`` (1e-5) for all but 0.1% of the elements, and one update (``lr /
10``, 1e-3) for those few, whose gradient cancels (measured up to 1.1e-4 on one element
of 16384 where XLA:CPU compiles the sums otherwise: another CPU, or another optimisation
level).
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxmoe.config import MoEConfig, ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.state import init_train_state
from tests.train.batches import train_steps
from tests.train.runs import assert_trained_close
from tests.train.test_step import small_config

STEPS = 3
MOE = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0)
REFERENCE = (ParallelConfig(data=2, expert=4), "all_to_all")
MAPPINGS = {
    "expert4-et2": (ParallelConfig(data=1, expert=4, expert_tensor=2), "all_to_all"),
    "data2-expert2-et2": (ParallelConfig(data=2, expert=2, expert_tensor=2), "all_to_all"),
    "data2-expert4-all_gather": (ParallelConfig(data=2, expert=4), "all_gather"),
}


@functools.cache
def train(parallel: ParallelConfig, dispatcher: str):
    config = small_config(parallel, dataclasses.replace(MOE, dispatcher=dispatcher))
    history, params = train_steps(config, steps=STEPS)
    return history, params, config


def experts_of(params):
    """The expert parameters of every MoE layer, by layer index."""
    blocks = params["blocks"].items()
    return {index: block["ffn"]["experts"] for index, block in blocks if "experts" in block["ffn"]}


# Expert hidden widths split over expert_tensor train as the unfolded layout by default in
# tests/train/test_tensor_parallel.py (d2e2t2et2-sequence: drops, the same tokens, the
# losses and gradient norm within 1e-6); here the expert-tensor mappings are slow, the
# all-gather dispatcher is the default case.
@pytest.mark.parametrize(
    "mapping",
    [pytest.param(name, marks=pytest.mark.slow if "et2" in name else ()) for name in MAPPINGS],
)
def test_same_training_as_the_unfolded_layout(mapping):
    reference, reference_params, _ = train(*REFERENCE)
    history, params, config = train(*MAPPINGS[mapping])

    assert all(m["dropped_fraction"] > 0 for m in reference), "capacity must force drops"
    for name in ("dropped_fraction", "tokens_per_expert"):
        np.testing.assert_array_equal(
            [m[name] for m in history], [m[name] for m in reference], err_msg=name
        )
    for name in ("loss", "aux_loss", "z_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[name] for m in history], [m[name] for m in reference], rtol=1e-6, err_msg=name
        )
    lr = config.train.learning_rate
    assert_trained_close(
        experts_of(params), experts_of(reference_params), rtol=0, atol=lr / 1000, update=lr / 10
    )
    assert_trained_close(params, reference_params, rtol=0, atol=lr / 1000, update=lr / 10)


def test_expert_state_is_split_over_the_expert_tensor_axis():
    config = small_config(MAPPINGS["expert4-et2"][0], MOE)
    state = init_train_state(resolve(config, build_mesh(config.parallel)))
    (experts,) = experts_of(state.params).values()
    spec = jax.sharding.PartitionSpec("expert", None, "expert_tensor")
    assert experts["w_in"].sharding.spec == spec
    # 8 experts over 4 devices, hidden 64 over 2: [2, d_model, 32] per device.
    assert experts["w_in"].addressable_shards[0].data.shape == (2, 32, 32)
    # Adam's moments follow the parameter.
    moments = [
        leaf
        for leaf in jax.tree.leaves(state.opt_state)
        if getattr(leaf, "shape", None) == experts["w_in"].shape
    ]
    assert len(moments) >= 2
    assert all(moment.sharding.spec == spec for moment in moments)
