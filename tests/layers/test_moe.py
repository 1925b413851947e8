"""The expert-parallel MoE layer against an independent single-device reference.

The reference below is plain jax.numpy with explicit Python loops: it routes
with the documented rule (top-k by float32 logits, per-group capacity
``ceil(group_size * top_k * capacity_factor / num_experts)``, choice-major then
token-order dropping) and applies every expert MLP by hand. It shares nothing
with the library but the parameters, which it reads from a freshly built
``MoELayer``. The layer runs on a mesh of 8 fake CPU devices (see
``tests/conftest.py``) with the experts sharded over the ``expert`` axis.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import MoEConfig, ParallelConfig
from jaxmoe.layers.moe import MoELayer
from jaxmoe.parallel.mesh import build_mesh

BATCH, SEQ, D_MODEL, D_HIDDEN, NUM_EXPERTS = 8, 8, 16, 32, 8


@dataclass(frozen=True)
class Case:
    name: str
    top_k: int
    capacity_factor: float | None
    score_function: str = "softmax"
    normalize_top_k: bool = True
    group_size: int | None = None
    data: int = 1
    expert: int = 8
    seed: int = 0

    @property
    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            num_experts=NUM_EXPERTS,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            score_function=self.score_function,
            normalize_top_k=self.normalize_top_k,
            group_size=self.group_size,
        )

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None


CASES = [
    Case("top1-capacity", top_k=1, capacity_factor=1.0),
    Case("top2-capacity", top_k=2, capacity_factor=1.0),
    Case("top1-dropless", top_k=1, capacity_factor=None),
    Case("top2-dropless", top_k=2, capacity_factor=None),
    Case("top2-sigmoid-capacity", top_k=2, capacity_factor=1.0, score_function="sigmoid"),
    Case(
        "data2-expert4-top2-unnormalised-groups4",
        top_k=2,
        capacity_factor=1.25,
        normalize_top_k=False,
        group_size=4,
        data=2,
        expert=4,
    ),
]
with_every_case = pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])


# --- The reference -----------------------------------------------------------------------------


def reference_scores(params, tokens, score_function):
    """Float32 router scores ``[tokens, experts]``, and the logits they come from."""
    logits = tokens.astype(jnp.float32) @ params["router"]["kernel"]
    if score_function == "softmax":
        return jax.nn.softmax(logits, axis=-1), logits
    return jax.nn.sigmoid(logits), logits


def reference_capacity(case):
    group_size = case.group_size or SEQ
    if case.dropless:
        return group_size
    return math.ceil(group_size * case.top_k * case.capacity_factor / NUM_EXPERTS)


def reference_routing(logits, case):
    """Top-k experts and which assignments survive capacity, token by token.

    ``logits`` is ``[tokens, experts]`` (numpy); returns ``expert_index`` and
    ``kept``, both ``[tokens, top_k]``.
    """
    num_tokens = logits.shape[0]
    group_size = case.group_size or SEQ
    capacity = reference_capacity(case)
    expert_index = np.zeros((num_tokens, case.top_k), np.int64)
    for token in range(num_tokens):
        # Highest logit (so highest score) first; ties to the lower expert index.
        ranked = sorted(range(NUM_EXPERTS), key=lambda e, t=token: (-logits[t, e], e))
        expert_index[token] = ranked[: case.top_k]
    kept = np.zeros((num_tokens, case.top_k), bool)
    for start in range(0, num_tokens, group_size):  # capacity is counted per group
        filled = [0] * NUM_EXPERTS
        for choice in range(case.top_k):  # all first choices before any second choice
            for token in range(start, start + group_size):  # then in token order
                expert = expert_index[token, choice]
                if filled[expert] < capacity:
                    filled[expert] += 1
                    kept[token, choice] = True
    return expert_index, kept


def reference_forward(params, x, expert_index, kept, case):
    """``[batch, seq, d] -> [batch, seq, d]`` given the routing decisions (piecewise constant)."""
    tokens = x.reshape(-1, D_MODEL)
    scores, _ = reference_scores(params, tokens, case.score_function)
    weights = jnp.stack(
        [scores[np.arange(len(tokens)), expert_index[:, c]] for c in range(case.top_k)], axis=-1
    )
    if case.top_k > 1 and case.normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    experts = params["experts"]
    # Every expert's MLP on every token: [tokens, experts, d].
    hidden = jnp.einsum("td,edh->teh", tokens, experts["w_in"]) + experts["b_in"]
    hidden = jax.nn.gelu(hidden, approximate=True)
    every_output = jnp.einsum("teh,ehd->ted", hidden, experts["w_out"]) + experts["b_out"]
    y = jnp.zeros_like(tokens)
    for choice in range(case.top_k):
        chosen = every_output[np.arange(len(tokens)), expert_index[:, choice]]  # [tokens, d]
        contribution = weights[:, choice : choice + 1] * chosen
        y = y + jnp.where(kept[:, choice][:, None], contribution, 0.0)  # dropped: nothing
    return y.reshape(x.shape)


def reference_router_loss(params, x, expert_index, case):
    """``aux_loss + z_loss / 2`` as a differentiable function (the routing is held fixed)."""
    tokens = x.reshape(-1, D_MODEL)
    scores, logits = reference_scores(params, tokens, case.score_function)
    group_size = case.group_size or SEQ
    groups = len(tokens) // group_size
    # fraction[g, e]: share of group g's assignments that chose expert e (piecewise constant).
    fraction = np.zeros((groups, NUM_EXPERTS))
    for token, experts in enumerate(expert_index):
        for expert in experts:
            fraction[token // group_size, expert] += 1 / (group_size * case.top_k)
    probabilities = scores / jnp.sum(scores, axis=-1, keepdims=True)
    mean_probability = jnp.mean(probabilities.reshape(groups, group_size, -1), axis=1)
    aux_loss = jnp.mean(NUM_EXPERTS * jnp.sum(fraction * mean_probability, axis=-1))
    z_loss = jnp.mean(jnp.log(jnp.sum(jnp.exp(logits), axis=-1)) ** 2)
    return aux_loss + z_loss / 2


def mesh_router_loss(stats):
    return stats.aux_loss + stats.z_loss / 2


def reference_stats(scores, logits, expert_index, kept, case):
    """Aux loss (Switch, mean over groups), z-loss, counts: numpy in float64."""
    scores = np.asarray(scores, np.float64)
    group_size = case.group_size or SEQ
    per_group = []
    for start in range(0, len(scores), group_size):
        group = slice(start, start + group_size)
        probabilities = scores[group] / scores[group].sum(-1, keepdims=True)
        fraction = np.bincount(expert_index[group].ravel(), minlength=NUM_EXPERTS) / (
            group_size * case.top_k
        )
        per_group.append(NUM_EXPERTS * np.sum(fraction * probabilities.mean(0)))
    logits = np.asarray(logits, np.float64)
    logsumexp = np.log(np.exp(logits).sum(-1))
    return {
        "aux_loss": np.mean(per_group),
        "z_loss": np.mean(logsumexp**2),
        "tokens_per_expert": np.bincount(expert_index.ravel(), minlength=NUM_EXPERTS),
        "dropped": int(np.sum(~kept)),
        "assignments": expert_index.size,
    }


class Result(NamedTuple):
    y: np.ndarray
    grads: dict  # {'router': {'kernel'}, 'experts': {...}} of numpy arrays
    grad_x: np.ndarray
    stats: dict
    router_loss_grads: dict  # gradients of aux_loss + z_loss / 2, same layout as grads
    router_loss_grad_x: np.ndarray


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


@functools.cache
def inputs(case):
    """The layer's parameters (numpy pure dict), the input and a fixed cotangent."""
    layer = make_layer(case)
    params = to_numpy(nnx.to_pure_dict(nnx.state(layer)))
    rng = np.random.default_rng(case.seed + 100)
    x = rng.normal(size=(BATCH, SEQ, D_MODEL)).astype(np.float32)
    cotangent = rng.normal(size=(BATCH, SEQ, D_MODEL)).astype(np.float32)
    return params, x, cotangent


def make_layer(case):
    """A fresh layer, with non-zero biases and a sharper router than at initialisation.

    Zero biases would hide a bias applied to the wrong expert; a near-uniform router
    would leave near-ties that rounding could flip.
    """
    layer = MoELayer(
        D_MODEL, D_HIDDEN, case.moe_config, dtype=jnp.float32, rngs=nnx.Rngs(case.seed)
    )
    rng = np.random.default_rng(case.seed + 1)
    state = nnx.state(layer)
    params = nnx.to_pure_dict(state)
    params["router"]["kernel"] = params["router"]["kernel"] * 4.0
    for name in ("b_in", "b_out"):
        shape = params["experts"][name].shape
        params["experts"][name] = jnp.asarray(rng.normal(0, 0.5, shape), jnp.float32)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(layer, state)
    return layer


@functools.cache
def reference_result(case):
    params, x, cotangent = inputs(case)
    scores, logits = reference_scores(
        params, jnp.asarray(x).reshape(-1, D_MODEL), case.score_function
    )
    expert_index, kept = reference_routing(np.asarray(logits), case)

    def losses(params, x):
        y = reference_forward(params, x, expert_index, kept, case)
        router_loss = reference_router_loss(params, x, expert_index, case)
        return (jnp.sum(y * cotangent), router_loss), y

    def step(params, x):  # eager: the cases share shapes, so op compiles are reused
        _, pullback, y = jax.vjp(losses, params, x, has_aux=True)
        return y, pullback((1.0, 0.0)), pullback((0.0, 1.0))

    y, (grads, grad_x), (router_grads, router_grad_x) = step(params, x)
    return Result(
        y=np.asarray(y),
        grads=to_numpy(grads),
        grad_x=np.asarray(grad_x),
        stats=reference_stats(scores, logits, expert_index, kept, case),
        router_loss_grads=to_numpy(router_grads),
        router_loss_grad_x=np.asarray(router_grad_x),
    )


@functools.cache
def mesh_result(case):
    """Forward, stats and gradients of the layer on a (data, expert) mesh, in one compile."""
    _, x, cotangent = inputs(case)
    layer = make_layer(case)
    graphdef, state = nnx.split(layer)
    mesh = build_mesh(ParallelConfig(data=case.data, expert=case.expert))

    def losses(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        return (jnp.sum(y * cotangent), mesh_router_loss(stats)), (y, stats)

    @jax.jit
    def step(state, x):
        # One forward pass, then one backward pass per scalar loss.
        _, pullback, (y, stats) = jax.vjp(losses, state, x, has_aux=True)
        return y, stats, pullback((1.0, 0.0)), pullback((0.0, 1.0))

    with jax.set_mesh(mesh):
        x_sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "expert"))))
        y, stats, (grad_state, grad_x), (router_grads, router_grad_x) = step(state, x_sharded)
    return Result(
        y=np.asarray(y),
        grads=to_numpy(nnx.to_pure_dict(grad_state)),
        grad_x=np.asarray(grad_x),
        stats={name: np.asarray(value) for name, value in stats._asdict().items()},
        router_loss_grads=to_numpy(nnx.to_pure_dict(router_grads)),
        router_loss_grad_x=np.asarray(router_grad_x),
    )


# --- The tests ---------------------------------------------------------------------------------


@with_every_case
def test_reference_drops_exactly_when_capacity_is_short(case):
    dropped = reference_result(case).stats["dropped"]
    if case.dropless:
        assert dropped == 0
    else:
        assert dropped > 0, "the capacity factor is meant to force drops"


@with_every_case
def test_forward_matches_reference(case):
    got, want = mesh_result(case), reference_result(case)

    assert got.y.shape == (BATCH, SEQ, D_MODEL)
    np.testing.assert_allclose(got.y, want.y, atol=1e-5, rtol=1e-5)
    if case.dropless:
        assert got.stats["dropped"] == 0
    else:
        assert got.stats["dropped"] > 0


@with_every_case
def test_gradients_of_every_parameter_and_the_input_match_reference(case):
    got, want = mesh_result(case), reference_result(case)

    assert jax.tree.structure(got.grads) == jax.tree.structure(want.grads)
    names = ["router/kernel"] + [f"experts/{n}" for n in ("w_in", "b_in", "w_out", "b_out")]
    for name in names:
        section, leaf = name.split("/")
        np.testing.assert_allclose(
            got.grads[section][leaf], want.grads[section][leaf], rtol=1e-4, atol=1e-4, err_msg=name
        )
        assert np.any(want.grads[section][leaf] != 0), f"{name}: the reference gradient is zero"
    np.testing.assert_allclose(got.grad_x, want.grad_x, rtol=1e-4, atol=1e-4, err_msg="input")


@with_every_case
def test_gradients_of_the_router_losses_match_reference(case):
    got, want = mesh_result(case), reference_result(case)

    np.testing.assert_allclose(
        got.router_loss_grads["router"]["kernel"],
        want.router_loss_grads["router"]["kernel"],
        rtol=1e-4,
        atol=1e-5,
    )
    assert np.any(want.router_loss_grads["router"]["kernel"] != 0)
    for name, gradient in got.router_loss_grads["experts"].items():
        np.testing.assert_array_equal(gradient, 0, err_msg=f"experts/{name}")
    np.testing.assert_allclose(
        got.router_loss_grad_x, want.router_loss_grad_x, rtol=1e-4, atol=1e-5
    )


@with_every_case
def test_routing_stats_match_reference(case):
    got, want = mesh_result(case).stats, reference_result(case).stats
    assignments = BATCH * SEQ * case.top_k

    assert int(got["tokens_per_expert"].sum()) == assignments
    np.testing.assert_array_equal(got["tokens_per_expert"], want["tokens_per_expert"])
    assert int(got["assignments"]) == assignments
    assert int(got["dropped"]) == want["dropped"]
    np.testing.assert_allclose(got["aux_loss"], want["aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(got["z_loss"], want["z_loss"], rtol=1e-5)


def test_layer_without_mesh_matches_reference():
    case = CASES[1]
    _, x, _ = inputs(case)
    layer = make_layer(case)

    y, stats = jax.jit(lambda x: layer(x))(x)

    np.testing.assert_allclose(y, reference_result(case).y, atol=1e-5, rtol=1e-5)
    assert int(stats.dropped) == reference_result(case).stats["dropped"]


def test_jitter_noise_differs_between_devices_on_the_mesh():
    # Every device gets the same sequence; with per-device noise their outputs must differ.
    case = Case("top1-jitter", top_k=1, capacity_factor=None)
    config = dataclasses.replace(case.moe_config, jitter=0.5)
    layer = MoELayer(D_MODEL, D_HIDDEN, config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    _, x, _ = inputs(case)
    same_everywhere = np.broadcast_to(x[:1], x.shape)
    mesh = build_mesh(ParallelConfig(data=1, expert=8))

    with jax.set_mesh(mesh):
        x_sharded = jax.device_put(
            same_everywhere, NamedSharding(mesh, PartitionSpec(("data", "expert")))
        )
        call = jax.jit(lambda x, key: layer(x, key)[0])
        noisy = np.asarray(call(x_sharded, jax.random.key(0)))
        again = np.asarray(call(x_sharded, jax.random.key(0)))

    np.testing.assert_array_equal(noisy, again)
    for device in range(1, BATCH):
        assert not np.allclose(noisy[device], noisy[0]), f"device {device} saw device 0's noise"


@nnx.jit
def _per_device(layer, x):
    """The layer's per-device body, compiled once (eagerly, each op compiles alone)."""
    return layer.per_device(x)


def test_sequence_aux_loss_and_group_aux_loss_on_a_hand_computed_example():
    # Four experts, top-1, routing groups of two tokens in rows of four. The router's kernel
    # is the identity, so each token's logits are log(p): its softmax scores are p.
    config = MoEConfig(
        num_experts=4, top_k=1, capacity_factor=None, group_size=2, seq_aux_loss_coef=1.0
    )
    layer = MoELayer(4, 8, config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    layer.router.kernel[...] = jnp.eye(4, dtype=jnp.float32)
    p = np.array(
        [
            [
                [0.7, 0.1, 0.1, 0.1],
                [0.7, 0.1, 0.1, 0.1],
                [0.1, 0.7, 0.1, 0.1],
                [0.4, 0.3, 0.2, 0.1],
            ],
            [[0.25] * 4] * 4,  # every expert ties: every token goes to expert 0
        ],
        np.float32,
    )

    _, stats = _per_device(layer, jnp.log(jnp.asarray(p)))

    # Row 0 sends 3 tokens to expert 0 and 1 to expert 1: f = E / (K T) x counts = (3, 1, 0,
    # 0); P = mean score = (1.9, 1.2, 0.5, 0.4) / 4; f . P = 3 x 0.475 + 0.3 = 1.725.
    # Row 1: f = (4, 0, 0, 0), P = 0.25 each: 1.0. The sequence-wise loss is their mean.
    np.testing.assert_allclose(stats.seq_aux_loss, (1.725 + 1.0) / 2, rtol=1e-6)
    # Per group of two: (t0, t1) 4 x 0.7 = 2.8; (t2, t3) 4 x (0.5 x 0.25 + 0.5 x 0.5) = 1.5;
    # row 1's groups 1.0 each.
    np.testing.assert_allclose(stats.aux_loss, (2.8 + 1.5 + 1.0 + 1.0) / 4, rtol=1e-6)
    np.testing.assert_array_equal(stats.tokens_per_expert, [7, 1, 0, 0])


def test_sequence_aux_loss_is_zero_when_its_coefficient_is():
    case = CASES[1]
    _, x, _ = inputs(case)
    _, stats = _per_device(make_layer(case), jnp.asarray(x))

    assert float(stats.seq_aux_loss) == 0.0
