"""``model.recompute="matmuls"`` (and ``"matmuls_offload"``): a block keeps its matmuls',
exchanges' and flash attention core's results and recomputes the rest.

It trains as ``"none"`` does (the same tolerances as tests/layers/test_recompute_layer.py:
the losses over the steps 2e-6 relative, the parameters lr / 200). In the captured step
the backward pass repeats no collective and no matmul; the values it keeps for the
backward pass lie between full recomputation's and none's, and so does the memory walk's
peak; of a blockwise core that loops over tiles it keeps no more than ``"none"`` does
(nothing of the loop's iterations). The offloading policy keeps the same values, in host
memory, and computes the same step.
"""

import functools
import re

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.plan.memory import backward_start, step_memory
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step
from scheduling import saved_for_backward
from scheduling.program.capture import Phase
from tests.pipeline.test_pipelined import LR, config, devices, trained

COLLECTIVES = {"all_to_all", "all_gather", "reduce_scatter", "psum", "ppermute"}


@functools.cache
def _program(recompute: str, **model_fields):
    each = config("plain", recompute=recompute, microbatches=1, **model_fields)
    return capture_train_step(resolve(each, build_mesh(each.parallel, devices(each))))[0]


def _backward(program, primitives) -> list:
    return [op for op in program.ops if op.phase is Phase.BACKWARD and op.primitive in primitives]


def test_keeping_matmuls_trains_as_keeping_everything():
    # Two layers: a dense block and an MoE block, each with the policy.
    (history, state, _), (expected, expected_state, _) = (
        trained(config("plain", recompute="matmuls", microbatches=1, num_layers=2)),
        trained(config("plain", microbatches=1, num_layers=2)),
    )
    assert history[0]["loss"] == expected[0]["loss"]
    for key in ("loss", "aux_loss", "z_loss"):
        np.testing.assert_allclose(
            [m[key] for m in history], [m[key] for m in expected], rtol=2e-6, err_msg=key
        )
    np.testing.assert_array_equal(
        [m["tokens_per_expert"] for m in history], [m["tokens_per_expert"] for m in expected]
    )
    chex.assert_trees_all_close(state.params, expected_state.params, rtol=0, atol=LR / 200)


@pytest.mark.parametrize("recompute", ["matmuls", "matmuls_offload"])
def test_the_backward_pass_repeats_no_collective_and_no_matmul(recompute):
    program, plain = _program(recompute), _program("none")
    assert len(_backward(program, COLLECTIVES)) == len(_backward(plain, COLLECTIVES))
    recomputed = [op for op in program.ops if "rematted_computation" in op.name_stack]
    assert recomputed  # norms, activations, routing
    assert not [op for op in recomputed if op.primitive == "dot_general"]


def _in_the_core(op) -> bool:
    return "attention_core" in op.name_stack


def test_a_blockwise_loop_keeps_nothing_of_its_tiles():
    # Four tiles of four positions, ten visited: a policy that keeps matmuls' results
    # applies inside the core's loop too, and would keep every tile's scores unless the
    # core's output and log-sum-exp were kept by name.
    tiled = dict(attention_block=4)
    kept = {
        r: saved_for_backward(_program(r, **tiled), made_by=_in_the_core).bytes
        for r in ("none", "matmuls")
    }
    assert 0 < kept["matmuls"] <= kept["none"]


def test_the_flash_core_keeps_its_output_in_the_models_dtype():
    """Its output is a buffer of its own: when the backward pass begins, the core holds its
    output in bfloat16, and of its loop's float32 results the rows' log-sum-exp alone, not
    the accumulator the output is made from."""
    fields = dict(attention_block=4, dtype="bfloat16")
    program = _program("none", **fields)
    state = resolve(config("plain", microbatches=1, **fields)).state_shapes
    start = backward_start(program, state, re.compile("attention_core"))
    made_by = {value: op.primitive for op in program.ops for value in op.outputs}
    kept = [(made_by[value], value.aval) for value, in_core in start.kept.items() if in_core]
    outputs = [aval for _, aval in kept if aval.dtype == jnp.bfloat16 and aval.ndim == 4]
    assert outputs  # [batch, positions, heads, head width]
    looped = [aval for made, aval in kept if made == "scan" and aval.size >= outputs[0].size]
    assert not looped, looped


def test_what_a_block_keeps_lies_between_full_recomputation_and_none():
    kept = {r: saved_for_backward(_program(r)).bytes for r in ("none", "matmuls", "layer")}
    assert kept["layer"] < kept["matmuls"] < kept["none"]
    each = config("plain", microbatches=1)
    state = resolve(each).state_shapes
    peaks = {r: step_memory(_program(r), state).total for r in ("none", "matmuls", "layer")}
    assert peaks["layer"] <= peaks["matmuls"] <= peaks["none"]


def test_offloading_moves_the_kept_values_to_host_memory_and_back():
    offloaded = _program("matmuls_offload")
    moves = [op for op in offloaded.ops if op.primitive == "device_put"]
    forward = [op for op in moves if op.phase is Phase.FORWARD]
    backward = [op for op in moves if op.phase is Phase.BACKWARD]
    assert forward and backward
    assert all("Host" in str(op.eqn.params["devices"]) for op in forward)
