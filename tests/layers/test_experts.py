"""The experts: one GELU MLP per expert slot, against plain jax.numpy on the same weights.

The reference loops over the experts and applies each one's two matmuls by hand
(tanh-approximated GELU, written out). The expert-tensor test splits the hidden
dimension inside a shard_map on the 8 fake CPU devices (``tests/conftest.py``) and
sums the partial outputs, as the dispatchers do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.config.layout import EXPERT, EXPERT_TENSOR, axes_for_role
from jaxmoe.layers.experts import Experts
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.parallel.sharding import param_specs

NUM_EXPERTS, D_MODEL, D_HIDDEN, TOKENS = 4, 16, 32, 6
NAMES = ("w_in", "b_in", "w_out", "b_out")


def make_experts(seed=0, dtype=jnp.float32):
    """Experts with non-zero biases: zero biases would hide a bias applied to the wrong slot."""
    experts = Experts(NUM_EXPERTS, D_MODEL, D_HIDDEN, dtype=dtype, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    experts.b_in[...] = jnp.asarray(rng.normal(0, 0.5, (NUM_EXPERTS, D_HIDDEN)), jnp.float32)
    experts.b_out[...] = jnp.asarray(rng.normal(0, 0.5, (NUM_EXPERTS, D_MODEL)), jnp.float32)
    return experts


def params_of(experts):
    return nnx.to_pure_dict(nnx.state(experts))


def slot_input(seed=2, slots=NUM_EXPERTS):
    return np.random.default_rng(seed).normal(size=(slots, TOKENS, D_MODEL)).astype(np.float32)


def gelu_tanh(x):
    return 0.5 * x * (1 + jnp.tanh(jnp.sqrt(2 / jnp.pi) * (x + 0.044715 * x**3)))


def reference_experts(params, x, slot_expert=None):
    """Slot ``i`` of ``x`` through expert ``slot_expert[i]``'s MLP (a zero MLP for -1)."""
    slot_expert = range(NUM_EXPERTS) if slot_expert is None else slot_expert
    outputs = []
    for slot, expert in enumerate(slot_expert):
        if expert < 0:
            outputs.append(jnp.zeros_like(x[slot]))
            continue
        hidden = gelu_tanh(x[slot] @ params["w_in"][expert] + params["b_in"][expert])
        outputs.append(hidden @ params["w_out"][expert] + params["b_out"][expert])
    return jnp.stack(outputs)


def test_output_matches_the_per_expert_reference():
    experts = make_experts()
    x = slot_input()

    y = jax.jit(experts.__call__)(jnp.asarray(x))

    assert y.shape == (NUM_EXPERTS, TOKENS, D_MODEL)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, reference_experts(params_of(experts), x), rtol=1e-5, atol=1e-5)


def test_parameters_have_an_expert_axis_and_distinct_experts():
    params = params_of(make_experts())

    assert params["w_in"].shape == (NUM_EXPERTS, D_MODEL, D_HIDDEN)
    assert params["b_in"].shape == (NUM_EXPERTS, D_HIDDEN)
    assert params["w_out"].shape == (NUM_EXPERTS, D_HIDDEN, D_MODEL)
    assert params["b_out"].shape == (NUM_EXPERTS, D_MODEL)
    for name in ("w_in", "w_out"):
        weights = np.asarray(params[name])
        for expert in range(1, NUM_EXPERTS):
            assert not np.allclose(weights[expert], weights[0]), f"{name}: experts share values"
    # Fan-in scaling over d_model (w_in) and d_hidden (w_out), not over the expert axis.
    np.testing.assert_allclose(np.std(params["w_in"]), 1 / np.sqrt(D_MODEL), rtol=0.15)
    np.testing.assert_allclose(np.std(params["w_out"]), 1 / np.sqrt(D_HIDDEN), rtol=0.15)
    fresh = params_of(Experts(NUM_EXPERTS, D_MODEL, D_HIDDEN, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    np.testing.assert_array_equal(fresh["b_in"], 0)
    np.testing.assert_array_equal(fresh["b_out"], 0)


def test_partial_output_plus_output_bias_is_the_output():
    experts = make_experts()
    x = jnp.asarray(slot_input())

    bias = experts.output_bias()

    assert bias.shape == (NUM_EXPERTS, 1, D_MODEL)
    np.testing.assert_array_equal(bias[:, 0], experts.b_out[...])
    np.testing.assert_allclose(experts.partial_output(x) + bias, experts(x), rtol=1e-6, atol=1e-6)


def test_rejects_an_input_of_the_wrong_width_or_slot_count():
    experts = make_experts()
    with pytest.raises(AssertionError, match="experts input"):
        experts(jnp.zeros((NUM_EXPERTS, TOKENS, D_MODEL + 1)))
    with pytest.raises(AssertionError, match="experts input"):
        experts(jnp.zeros((NUM_EXPERTS + 1, TOKENS, D_MODEL)))


def test_compute_dtype_is_the_module_dtype_and_parameters_stay_float32():
    experts = make_experts(dtype=jnp.bfloat16)
    x = slot_input()

    y = experts(jnp.asarray(x))

    assert y.dtype == jnp.bfloat16
    assert all(value.dtype == jnp.float32 for value in params_of(experts).values())
    np.testing.assert_allclose(
        np.asarray(y, np.float32), reference_experts(params_of(experts), x), rtol=0.05, atol=0.05
    )


def test_gradients_match_the_reference_and_reach_only_experts_that_received_tokens():
    experts = make_experts()
    graphdef, state = nnx.split(experts)
    params = nnx.to_pure_dict(state)
    rng = np.random.default_rng(3)
    x = slot_input()
    cotangent = rng.normal(size=x.shape).astype(np.float32)
    idle = 2  # no token reached expert 2: its slot is zeros and nothing reads its output
    x[idle] = 0.0
    cotangent[idle] = 0.0

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(jnp.asarray(x)) * cotangent)

    def reference_loss(params):
        return jnp.sum(reference_experts(params, x) * cotangent)

    grads = jax.jit(jax.grad(loss))(params)
    expected = jax.jit(jax.grad(reference_loss))(params)

    for name in NAMES:
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(grads[name][idle], 0, err_msg=f"{name} of the idle expert")
        for expert in set(range(NUM_EXPERTS)) - {idle}:
            assert np.all(np.any(grads[name][expert] != 0, axis=-1)), f"{name}[{expert}]"


def test_replica_slots_compute_their_expert_and_empty_slots_output_zero():
    experts = make_experts()
    params = params_of(experts)
    table = jnp.array([[2, -1]], jnp.int32)  # one device: a copy of expert 2, then an empty slot
    x = slot_input(slots=NUM_EXPERTS + 2)

    y = experts(jnp.asarray(x), table)

    assert y.shape == (NUM_EXPERTS + 2, TOKENS, D_MODEL)
    expected = reference_experts(params, x, slot_expert=[0, 1, 2, 3, 2, -1])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[-1], 0)


def test_a_replica_gradient_goes_to_its_home_expert():
    experts = make_experts()
    graphdef, state = nnx.split(experts)
    params = nnx.to_pure_dict(state)
    table = jnp.array([[2, -1]], jnp.int32)
    x = slot_input(slots=NUM_EXPERTS + 2)
    cotangent = np.random.default_rng(4).normal(size=x.shape).astype(np.float32)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(jnp.asarray(x), table) * cotangent)

    def reference_loss(params):
        # Expert 2 sees its home tokens and the replica's: one gradient, summed.
        y = reference_experts(params, x, slot_expert=[0, 1, 2, 3, 2, -1])
        return jnp.sum(y * cotangent)

    grads = jax.jit(jax.grad(loss))(params)
    expected = jax.jit(jax.grad(reference_loss))(params)

    for name in NAMES:
        assert grads[name].shape == params[name].shape
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
    # Without the replica's tokens expert 2's gradient would differ.
    home_only = jax.jit(jax.grad(lambda p: jnp.sum(reference_experts(p, x[:4]) * cotangent[:4])))(
        params
    )
    assert not np.allclose(grads["w_in"][2], home_only["w_in"][2], rtol=1e-3)


# --- The hidden dimension split over the expert-tensor group --------------------------------

SPLIT_LAYOUTS = {
    "expert4-et2": ParallelConfig(data=1, expert=4, expert_tensor=2),
    "data2-et4": ParallelConfig(data=2, expert=1, expert_tensor=4),
}


@pytest.mark.parametrize("layout", list(SPLIT_LAYOUTS))
def test_expert_tensor_split_sums_to_the_unsplit_output_and_gradients(layout):
    parallel = SPLIT_LAYOUTS[layout]
    mesh = build_mesh(parallel)
    expert_axes = axes_for_role(EXPERT, mesh.axis_names)
    split_axes = axes_for_role(EXPERT_TENSOR, mesh.axis_names)
    experts = make_experts()
    graphdef, state = nnx.split(experts)
    params = nnx.to_pure_dict(state)
    specs = param_specs(state, mesh.shape)
    slots = PartitionSpec(expert_axes or None)
    local_shapes = []

    def body(params, x):
        local = nnx.merge(graphdef, params)
        local_shapes.append({name: params[name].shape for name in NAMES})
        partial = local.partial_output(x)
        return jax.lax.psum(partial, split_axes) + local.output_bias()

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(specs, slots), out_specs=slots)
    x = slot_input()
    cotangent = np.random.default_rng(5).normal(size=x.shape).astype(np.float32)

    def loss(params, x):
        return jnp.sum(mapped(params, x) * cotangent)

    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    x_placed = jax.device_put(x, NamedSharding(mesh, slots))
    y = jax.jit(mapped)(placed, x_placed)
    grads = jax.jit(jax.grad(loss))(placed, x_placed)

    local_experts = NUM_EXPERTS // parallel.expert
    local_hidden = D_HIDDEN // parallel.expert_tensor
    assert local_shapes[0] == {
        "w_in": (local_experts, D_MODEL, local_hidden),
        "b_in": (local_experts, local_hidden),
        "w_out": (local_experts, local_hidden, D_MODEL),
        "b_out": (local_experts, D_MODEL),
    }
    np.testing.assert_allclose(y, experts(jnp.asarray(x)), rtol=1e-5, atol=1e-5)
    expected = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(jnp.asarray(x)) * cotangent))(
        params
    )
    for name in NAMES:
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


# --- SwiGLU experts --------------------------------------------------------------------------


def test_swiglu_experts_match_the_per_expert_reference():
    experts = Experts(
        NUM_EXPERTS,
        D_MODEL,
        D_HIDDEN,
        activation="swiglu",
        bias=False,
        dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    params = params_of(experts)
    assert set(params) == {"w_in", "w_out"}
    assert params["w_in"].shape == (NUM_EXPERTS, D_MODEL, 2, D_HIDDEN)
    x = slot_input()

    y = experts(jnp.asarray(x))

    for expert in range(NUM_EXPERTS):
        gate = x[expert] @ params["w_in"][expert, :, 0]
        up = x[expert] @ params["w_in"][expert, :, 1]
        expected = (jax.nn.silu(gate) * up) @ params["w_out"][expert]
        np.testing.assert_allclose(y[expert], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(experts.output_bias(), np.zeros((NUM_EXPERTS, 1, D_MODEL)))
