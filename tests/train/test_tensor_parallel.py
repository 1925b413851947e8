"""Tensor and sequence parallelism: folded layouts train exactly as the unfolded one.

Routing groups are one whole sequence by default in every layout: under tensor
parallelism each device holds a slice of each row's positions, and the layer plans the
group from the choices gathered over the tensor group. So the same assignments are
dropped (capacity is per group), the per-group and per-sequence balance losses are the
same, and so is the expert bias of auxiliary-loss-free balancing, which follows the
routed counts. ``group_size = 4`` divides the ``seq_len / tensor`` positions a device
holds (16 / 2), so those groups need no gather; ``group_size = 32`` is two whole rows.
The runs then differ only in the order of floating-point reductions.
"""

import functools

import chex
import jax
import numpy as np
import pytest

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.config.layout import TENSOR, axes_for_role
from jaxmoe.losses import forward_losses
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.parallel.sharding import reduce_gradients
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step
from jaxmoe.train.state import init_train_state
from scheduling import Phase
from tests.train.batches import random_batch, train_steps

STEPS = 3
UNFOLDED = ParallelConfig(data=2, expert=4)
SEQUENCE = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0, seq_aux_loss_coef=1e-2)
LOCAL = MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0, group_size=4, seq_aux_loss_coef=1e-2)
# DeepSeek-V3's routing, dropless, in groups of two rows.
DEEPSEEK = MoEConfig(
    num_experts=8,
    top_k=2,
    capacity_factor=None,
    group_size=32,
    score_function="sigmoid",
    routed_scaling_factor=2.5,
    num_expert_groups=4,
    top_k_expert_groups=2,
    expert_bias_rate=1e-2,
)
CAPACITY = SEQUENCE
# tensor groups inside the data axis; tensor groups spanning the whole expert group; tensor
# groups of 4 over two mesh axes, the expert group straddling tensor and data; tensor and
# expert-tensor parallelism together.
FOLDED = {
    "d2e4t2": ParallelConfig(data=2, expert=4, tensor=2),
    "d1e8t2": ParallelConfig(data=1, expert=8, tensor=2),
    "d4e2t4": ParallelConfig(data=4, expert=2, tensor=4),
    "d2e2t2et2": ParallelConfig(data=2, expert=2, tensor=2, expert_tensor=2),
}


def small_config(parallel: ParallelConfig, moe: MoEConfig) -> Config:
    # Layer 0 has a dense FFN, layer 1 an MoE FFN; 4 heads split 2 or 4 ways.
    return Config(
        model=ModelConfig(d_model=32, num_heads=4, num_layers=2, d_ff=64, seq_len=16),
        moe=moe,
        parallel=parallel,
        train=TrainConfig(batch_size=16, steps=STEPS, warmup_steps=1, learning_rate=1e-2),
    )


@functools.cache
def run_steps(parallel: ParallelConfig, moe: MoEConfig):
    return train_steps(small_config(parallel, moe))


@functools.cache
def initial_params(parallel: ParallelConfig):
    """The initial parameters on ``parallel``'s mesh, as the train state places them."""
    config = small_config(parallel, CAPACITY)
    return init_train_state(resolve(config, build_mesh(config.parallel))).params


@functools.cache
def first_gradients(parallel: ParallelConfig):
    """The reduced gradients of the first step (the global mean loss's gradient)."""
    config = small_config(parallel, CAPACITY)
    mesh = build_mesh(config.parallel)
    resolved = resolve(config)
    graphdef, specs = resolved.graphdef, resolved.model_specs
    shards = config.parallel.token_shards

    def per_device(params, batch):
        loss = lambda p: forward_losses(config, graphdef, p, batch, None).total / shards
        return reduce_gradients(jax.grad(loss)(params), specs)

    gradients = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(specs, token_spec(mesh)),
        out_specs=specs,
        check_vma=False,
    )
    batch = random_batch(np.random.default_rng(0), config, mesh)
    return jax.device_get(jax.jit(gradients)(initial_params(parallel), batch))


@pytest.mark.parametrize("layout", ["d4e2t4"])
def test_gradients_equal_the_unfolded_layouts_within_a_few_ulps(layout):
    reference = first_gradients(UNFOLDED)
    gradients = first_gradients(FOLDED[layout])
    # Relative to each parameter's largest gradient: elements that are sums of cancelling
    # terms have no relative precision of their own. 4e-6 is about 32 float32 ulps of 1 (the
    # reductions over 16 devices come in another order); a wrong reduction is off by O(1).
    scale = jax.tree.map(lambda g: np.max(np.abs(g)), reference)
    chex.assert_trees_all_close(
        jax.tree.map(np.divide, gradients, scale),
        jax.tree.map(np.divide, reference, scale),
        rtol=0,
        atol=4e-6,
    )


# Each case compiles two steps (its layout's and, once per MoE config, the unfolded one's).
CASES = [
    ("d2e4t2", LOCAL, "groups4"),
    ("d1e8t2", SEQUENCE, "sequence"),
    ("d2e2t2et2", SEQUENCE, "sequence"),
    ("d4e2t4", DEEPSEEK, "deepseek-two-rows-dropless"),
]


# d2e2t2et2 (every axis folded) by default; d4e2t4 (DeepSeek's routing) has its gradients
# compared by default (above).
SLOW_LAYOUTS = {"d2e4t2", "d1e8t2", "d4e2t4"}


@pytest.mark.parametrize(
    ("layout", "moe"),
    [
        pytest.param(
            name, moe, id=f"{name}-{label}",
            marks=pytest.mark.slow if name in SLOW_LAYOUTS else (),
        )
        for name, moe, label in CASES
    ],
)  # fmt: skip
def test_folded_layouts_train_as_the_unfolded_one(layout, moe):
    reference, reference_params = run_steps(UNFOLDED, moe)
    history, params = run_steps(FOLDED[layout], moe)
    dropped = [m["dropped_fraction"] for m in reference]
    assert all(d == 0 for d in dropped) if moe.dropless else all(d > 0 for d in dropped)
    names = ["loss", "total_loss", "aux_loss", "z_loss", "grad_norm"]
    if moe.seq_aux_loss_coef:
        names.append("seq_aux_loss")
    for name in names:
        # About 8 ulps: the sums over devices come in another order.
        np.testing.assert_allclose(
            [m[name] for m in history], [m[name] for m in reference], rtol=1e-6, err_msg=name
        )
    for name in ("dropped_fraction", "tokens_per_expert"):
        np.testing.assert_array_equal(
            [m[name] for m in history], [m[name] for m in reference], err_msg=name
        )
    # Adam's update is lr * m / (sqrt(v) + 1e-8): for an element whose gradient is near 1e-8
    # (a sum of cancelling terms) a round-off difference in the gradient moves the update by
    # up to lr = 1e-2. The gradients themselves agree to a few ulps (test above), so all but a
    # handful of elements agree to 1e-4, and none is off by more than the steps' updates.
    for path, value, expected in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(params),
        jax.tree.leaves(reference_params),
        strict=True,
    ):
        difference = np.abs(np.asarray(value) - np.asarray(expected))
        assert np.mean(difference > 1e-4) <= 1e-3, (path[0], np.mean(difference > 1e-4))
        assert np.max(difference) <= STEPS * 1e-2, (path[0], np.max(difference))


def test_tensor_collectives_are_equations_of_the_step_over_the_tensor_axes():
    config = small_config(FOLDED["d4e2t4"], CAPACITY)
    mesh = build_mesh(config.parallel)
    program, _ = capture_train_step(resolve(config, mesh))
    tensor_axes = axes_for_role(TENSOR, mesh.axis_names)
    assert tensor_axes == ("tensor_expert_data", "tensor_expert")

    def over_tensor(primitive: str, phase: Phase) -> int:
        ops = [op for op in program.collectives() if op.primitive == primitive]
        return sum(
            op.phase is phase and tuple(op.eqn.params["axis_name"]) == tensor_axes for op in ops
        )

    # Forward: an all-gather into and a reduce-scatter out of each attention and the dense
    # FFN (2 layers, 1 dense). The MoE layer's routing group is the whole sequence: it
    # all-gathers its expert choices, and, as each member sends a share of every expert's
    # places (jaxmoe/layers/routing_groups.py), the tokens and their combine weights in, and
    # reduce-scatters its outputs. Backward: the transposes of all but the choices' gather.
    assert over_tensor("all_gather", Phase.FORWARD) == 3 + 3
    assert over_tensor("reduce_scatter", Phase.FORWARD) == 3 + 1
    assert over_tensor("all_gather", Phase.BACKWARD) == 3 + 1
    assert over_tensor("reduce_scatter", Phase.BACKWARD) == 3 + 2
    choices = [
        op.eqn.invars[0].aval
        for op in program.collectives()
        if op.primitive == "all_gather" and op.eqn.invars[0].aval.dtype == np.int32
    ]
    assert [aval.shape for aval in choices] == [(8, 16 // 4, 2)]  # [rows, seq / tensor, k]

    unfolded, _ = capture_train_step(
        resolve(small_config(UNFOLDED, CAPACITY), build_mesh(UNFOLDED))
    )
    assert not {"all_gather", "reduce_scatter"} & {op.primitive for op in unfolded.collectives()}

    # A device holds as many tokens in both layouts (8 rows of 4 positions; 2 of 16), and
    # its experts' buffer is as large: a quarter of each slot's 4 places per group under
    # tensor 4, not all 4 for the 4 positions of a group it holds.
    def exchanged(program) -> list[int]:
        """The rows of each forward all-to-all: [members, slots each, groups x places, d]."""
        return [
            int(np.prod(op.eqn.invars[0].aval.shape[:-1]))
            for op in program.collectives()
            if op.primitive == "all_to_all" and op.phase is Phase.FORWARD
        ]

    assert exchanged(program) == exchanged(unfolded) == [8 * 2 * 4] * 2  # slots x groups x 4


def test_parameters_split_over_the_tensor_axes():
    params = initial_params(FOLDED["d4e2t4"])  # the gradient test's too
    tensor = ("tensor_expert_data", "tensor_expert")
    attention, ffn = params["blocks"][0]["attention"], params["blocks"][0]["ffn"]
    expected = {
        "query": (attention["query"]["kernel"], (None, tensor)),
        "key_value": (attention["key_value"]["kernel"], (None, None, tensor)),
        "out": (attention["out"]["kernel"], (tensor,)),
        "out bias": (attention["out"]["bias"], ()),
        "up": (ffn["up"]["kernel"], (None, tensor)),
        "up bias": (ffn["up"]["bias"], (tensor,)),
        "down": (ffn["down"]["kernel"], (tensor,)),
        "down bias": (ffn["down"]["bias"], ()),
    }
    for name, (array, spec) in expected.items():
        assert tuple(array.sharding.spec) == spec, name
    # A device's blocks hold whole heads: 4 heads of 8 split 4 ways, keys and values alike.
    assert attention["query"]["kernel"].addressable_shards[0].data.shape == (32, 1, 8)
    assert attention["key_value"]["kernel"].addressable_shards[0].data.shape == (32, 2, 1, 8)
