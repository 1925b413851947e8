"""The MoE layer's dispatcher: which strategy each configuration chooses, chosen once per
layer (and again only when its configuration is set), and the one path a call takes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.config import MoEConfig
from jaxmoe.experimental import ExperimentalOptions
from jaxmoe.layers import moe
from jaxmoe.layers.all_gather import AllGatherDispatch
from jaxmoe.layers.dispatchers import choose_dispatcher
from jaxmoe.layers.moe import MoELayer
from jaxmoe.layers.padded import PaddedDispatch
from jaxmoe.layers.ragged import RaggedDispatch
from jaxmoe.layers.replicated import (
    ReplicatedDispatch,
    ReplicatedRaggedDispatch,
    round_robin_slots,
)
from jaxmoe.placement.copy_split import balanced_slots

RAGGED = MoEConfig(capacity_factor=None, dropless_dispatch="ragged")
# (configuration, its dispatcher, its dispatcher over replica slots)
CHOICES = {
    "capacity": (MoEConfig(), PaddedDispatch, ReplicatedDispatch),
    "dropless-padded": (MoEConfig(capacity_factor=None), PaddedDispatch, ReplicatedDispatch),
    "all_gather": (MoEConfig(dispatcher="all_gather"), AllGatherDispatch, ReplicatedDispatch),
    "dropless-all_gather": (
        MoEConfig(capacity_factor=None, dispatcher="all_gather"),
        AllGatherDispatch,
        ReplicatedDispatch,
    ),
    "ragged": (RAGGED, RaggedDispatch, ReplicatedRaggedDispatch),
}


@pytest.mark.parametrize("name", CHOICES)
def test_each_configuration_chooses_its_dispatcher(name):
    config, plain, replicated = CHOICES[name]
    assert type(choose_dispatcher(config, replicas=False)) is plain
    assert type(choose_dispatcher(config, replicas=True)) is replicated


def test_the_replica_split_is_the_ragged_dispatchers_choice_of_copy():
    balanced = choose_dispatcher(RAGGED, replicas=True)
    round_robin = ExperimentalOptions(replica_split="round_robin")
    assert balanced.split is balanced_slots
    assert choose_dispatcher(RAGGED, replicas=True, experimental=round_robin).split is (
        round_robin_slots
    )


def _layer(config: MoEConfig) -> MoELayer:
    return MoELayer(8, 16, config, dtype=jnp.float32, rngs=nnx.Rngs(0))


def _tokens() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8)), jnp.float32)


def test_a_layer_chooses_its_dispatchers_once_not_per_call(monkeypatch):
    chosen = []

    def counting(config, replicas, *experimental):
        chosen.append((config.dispatcher, replicas))
        return choose_dispatcher(config, replicas, *experimental)

    monkeypatch.setattr(moe, "choose_dispatcher", counting)
    layer = _layer(MoEConfig(num_experts=4, top_k=2))
    assert chosen == [("all_to_all", False), ("all_to_all", True)]
    # The choice is Python's: calls traced (for their shapes) take the path a run takes.
    x, table = _tokens(), jnp.asarray([[0, 1]], jnp.int32)
    jax.eval_shape(lambda x: layer(x), x)
    jax.eval_shape(lambda x: layer(x, replica_table=table), x)
    graphdef, state = nnx.split(layer)
    jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)
    assert len(chosen) == 2
    # A new configuration chooses again.
    layer.config = dataclasses.replace(layer.config, dispatcher="all_gather")
    assert chosen[2:] == [("all_gather", False), ("all_gather", True)]
    assert type(layer.dispatcher) is AllGatherDispatch


class Recording:
    """A dispatcher that records the steps the layer asks of it."""

    def __init__(self, dispatcher, steps: list[str]):
        self.dispatcher, self.steps = dispatcher, steps

    def __getattr__(self, name):
        step = getattr(self.dispatcher, name)

        def recorded(*args):
            self.steps.append(name)
            return step(*args)

        return recorded


@pytest.mark.parametrize("with_table", [False, True], ids=["experts", "replica-slots"])
def test_a_call_takes_one_path_through_its_dispatcher(with_table):
    layer = _layer(MoEConfig(num_experts=4, top_k=2))
    steps, unused = [], []
    table = jnp.asarray([[0, 1]], jnp.int32) if with_table else None
    names = ("dispatcher", "replica_dispatcher")
    used, other = names[::-1] if with_table else names
    setattr(layer, used, Recording(getattr(layer, used), steps))
    setattr(layer, other, Recording(getattr(layer, other), unused))
    _, stats = jax.eval_shape(lambda x: layer(x, replica_table=table), _tokens())
    assert steps == ["plan", "send", "run_experts", "combine", "stats"]
    assert unused == []
    assert (stats.slot_load is not None) == with_table
