"""Both token dispatchers, with and without expert-tensor parallelism, against one device.

Routing groups are sequences and every device routes its own, so on any layout the layer
must keep and drop exactly the assignments the single-device layer drops on the same
tokens, and compute the same outputs and gradients up to the order of float32 sums (the
hidden dimension split in two sums its halves separately; the all_gather dispatcher adds
a token's choices in a reduce-scatter). The layer is the one of ``test_moe`` (non-zero
biases, so a bias added twice or never shows).
"""

import dataclasses
import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.parallel.sharding import param_specs
from tests.layers.test_moe import Case, inputs, make_layer

CASES = [
    Case("top1-capacity", top_k=1, capacity_factor=1.0),
    Case("top2-capacity", top_k=2, capacity_factor=1.0),
    Case("top2-dropless", top_k=2, capacity_factor=None),
]
LAYOUTS = {
    "expert4-et2": ParallelConfig(data=1, expert=4, expert_tensor=2),
    "data2-expert2-et2": ParallelConfig(data=2, expert=2, expert_tensor=2),
    "data2-expert4": ParallelConfig(data=2, expert=4),
    # Folded: the expert-tensor group spans attention's tensor axis and a data axis.
    "tensor2-expert2-et4": ParallelConfig(data=1, expert=2, tensor=2, expert_tensor=4),
}
# (layout, dispatcher); all_to_all without expert-tensor parallelism is test_moe's.
MAPPINGS = [
    (layout, dispatcher)
    for layout in LAYOUTS
    for dispatcher in ("all_to_all", "all_gather")
    if (layout, dispatcher) != ("data2-expert4", "all_to_all")
]


def layer_for(case: Case, dispatcher: str):
    layer = make_layer(case)
    layer.config = dataclasses.replace(case.moe_config, dispatcher=dispatcher)
    return layer


def forward_and_gradients(layer, x, cotangent, mesh=None):
    graphdef, state = nnx.split(layer)

    @jax.jit
    def run(state, x):
        def loss(state, x):
            y, stats = nnx.merge(graphdef, state)(x)
            return jnp.sum(y * cotangent), (y, stats)

        (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return y, stats, grads

    if mesh is None:
        y, stats, (grad_state, grad_x) = run(state, x)
    else:
        with jax.set_mesh(mesh):
            tokens = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
            y, stats, (grad_state, grad_x) = run(state, jax.device_put(x, tokens))
    return jax.device_get((y, stats, nnx.to_pure_dict(grad_state), grad_x))


@functools.cache
def one_device(case: Case):
    """The layer on one device, where both dispatchers are the same code (every expert
    local, no collective)."""
    _, x, cotangent = inputs(case)
    return forward_and_gradients(layer_for(case, "all_to_all"), x, cotangent)


def _layer_cases() -> list:
    """Every mapping with top2-capacity, and top-2 dropless on the folded layout with both
    dispatchers, by default; the rest of the cross product is slow (top-1 routing is
    tests/layers/test_moe.py's, on one device)."""
    return [
        pytest.param(
            case, layout, dispatcher, id=f"{case.name}-{layout}-{dispatcher}",
            marks=()
            if case.name == "top2-capacity"
            or (layout == "tensor2-expert2-et4" and case.name == "top2-dropless")
            else pytest.mark.slow,
        )
        for case in CASES
        for layout, dispatcher in MAPPINGS
    ]  # fmt: skip


@pytest.mark.parametrize(("case", "layout", "dispatcher"), _layer_cases())
def test_every_layout_drops_and_computes_what_one_device_does(case, layout, dispatcher):
    _, x, cotangent = inputs(case)
    want_y, want_stats, want_grads, want_grad_x = one_device(case)
    y, stats, grads, grad_x = forward_and_gradients(
        layer_for(case, dispatcher), x, cotangent, build_mesh(LAYOUTS[layout])
    )

    if case.dropless:
        assert int(stats.dropped) == 0
    else:
        assert int(want_stats.dropped) > 0, "the capacity factor is meant to force drops"
    assert int(stats.dropped) == int(want_stats.dropped)
    np.testing.assert_array_equal(stats.tokens_per_expert, want_stats.tokens_per_expert)
    # float32 sums in another order: a few ulps of outputs of order 1.
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    # Gradients sum over tokens (and, for the router, over experts) in another order.
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_x, want_grad_x, rtol=1e-5, atol=1e-6)


def collectives(layer, x, mesh) -> set[tuple[str, tuple[str, ...]]]:
    """(primitive, mesh axes) of every collective of the layer's forward pass."""
    found = set()

    def visit(jaxpr):
        for equation in jaxpr.eqns:
            axes = equation.params.get("axis_name", equation.params.get("axes"))
            if equation.primitive.name in ("all_gather", "reduce_scatter", "all_to_all"):
                found.add((equation.primitive.name, tuple(np.atleast_1d(axes))))
            for sub in jax.extend.core.jaxprs_in_params(equation.params):
                visit(sub)

    with jax.set_mesh(mesh):
        tokens = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
        visit(jax.make_jaxpr(lambda x: layer(x)[0])(jax.device_put(x, tokens)).jaxpr)
    return found


def test_the_dispatchers_use_the_collectives_they_document():
    case = CASES[1]
    _, x, _ = inputs(case)
    mesh = build_mesh(LAYOUTS["data2-expert2-et2"])

    assert collectives(layer_for(case, "all_to_all"), x, mesh) == {
        ("all_to_all", ("expert",)),
        ("all_gather", ("expert_tensor",)),
        ("reduce_scatter", ("expert_tensor",)),
    }
    assert collectives(layer_for(case, "all_gather"), x, mesh) == {
        ("all_gather", ("expert", "expert_tensor")),
        ("reduce_scatter", ("expert", "expert_tensor")),
    }


def test_expert_weights_are_split_over_the_expert_tensor_group():
    mesh = build_mesh(LAYOUTS["tensor2-expert2-et4"])
    layer = make_layer(CASES[0])
    with jax.set_mesh(mesh):
        specs = param_specs(nnx.state(layer))["experts"]
    et = ("expert_tensor", "tensor")  # the expert-tensor group of this folded mesh
    assert specs["w_in"] == PartitionSpec("expert", None, et)
    assert specs["b_in"] == PartitionSpec("expert", et)
    assert specs["w_out"] == PartitionSpec("expert", et)
    assert specs["b_out"] == PartitionSpec("expert")
