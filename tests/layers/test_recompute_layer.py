"""``model.recompute="layer"``: the backward pass runs each block again from its input.

It trains as ``"none"`` does: the forward pass is the same computation (the first loss
bit for bit), the gradients the same arithmetic in other XLA fusions. Tolerances: the
losses over 5 steps 2e-6 relative, Adam's first moment after one step 1e-5 relative, the
parameters after 5 steps lr / 200 (measured: the losses and parameters bit for bit, the
routers' losses as reported within 1e-7). The captured step keeps, of everything the
blocks compute, their inputs alone for the backward pass. Identical blocks are traced
once, into the same program. With the pipeline: tests/pipeline/test_pipelined.py
(interleaved case).
"""

import functools

import chex
import numpy as np
import pytest

from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.layers import recompute
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step
from scheduling import saved_for_backward
from scheduling.program.capture import Phase, Value
from tests.pipeline.test_pipelined import LR, MICROBATCHES, config, devices, trained

F32 = 4


@functools.cache
def _saved_by_scope(recompute: str) -> dict[str, list]:
    """The values the captured step's backward pass reads from its forward pass, by the
    scope that computed them (``microbatch_i/layer_j``, or what else)."""
    each = config("plain", recompute=recompute)
    program, _ = capture_train_step(resolve(each, build_mesh(each.parallel, devices(each))))
    made = {value: op for op in program.ops if op.phase is Phase.FORWARD for value in op.outputs}
    saved: dict[str, list] = {}
    for op in program.ops:
        if op.phase is not Phase.BACKWARD:
            continue
        for atom in op.inputs:
            if isinstance(atom, Value) and atom in made:
                parts = made[atom].layer.split("/")
                scope = "/".join(part for part in parts[:2] if part.startswith(("micro", "layer")))
                saved.setdefault(scope or parts[-1], set()).add(atom)
    assert saved_for_backward(program).count == sum(len(values) for values in saved.values())
    return {scope: sorted(values, key=id) for scope, values in saved.items()}


def test_the_flag_sets_the_field():
    assert config_from_train_args(["--model.recompute", "layer"]).model.recompute == "layer"


# By default the pipeline's interleaved case trains recomputed layers as the microbatch
# loop that keeps them (tests/pipeline/test_pipelined.py); here, with no pipeline, slow.
@pytest.mark.slow
def test_recomputing_layers_trains_as_keeping_them():
    # One microbatch: the pipeline's interleaved case recomputes over microbatches.
    recomputed, kept = (
        config("plain", recompute="layer", microbatches=1),
        config("plain", microbatches=1),
    )
    (history, state, first), (expected, expected_state, expected_first) = (
        trained(recomputed),
        trained(kept),
    )
    assert history[0]["loss"] == expected[0]["loss"]
    for key in ("dropped_fraction", "tokens_per_expert"):
        np.testing.assert_array_equal([m[key] for m in history], [m[key] for m in expected])
    for key in ("loss", "total_loss", "aux_loss", "z_loss"):
        np.testing.assert_allclose(
            [m[key] for m in history], [m[key] for m in expected], rtol=2e-6, err_msg=key
        )
    chex.assert_trees_all_close(
        first.opt_state[0].mu, expected_first.opt_state[0].mu, rtol=1e-5, atol=1e-9
    )
    chex.assert_trees_all_close(state.params, expected_state.params, rtol=0, atol=LR / 200)


def test_a_recomputed_block_keeps_its_input_alone():
    each = config("plain")
    model, rows = each.model, each.train.batch_size // each.parallel.batch_shards // MICROBATCHES
    block_input = (rows, model.seq_len, model.d_model)
    saved = _saved_by_scope("layer")
    blocks = {scope: values for scope, values in saved.items() if "layer_" in scope}
    # Block i + 1's input is block i's output; block 0's is the embedding, the last block's
    # output the head's input (saved by the head for its own backward pass).
    layers = range(model.num_layers - 1)
    assert set(blocks) == {f"microbatch_{m}/layer_{i}" for m in range(MICROBATCHES) for i in layers}
    for values in blocks.values():
        assert [value.aval.shape for value in values] == [block_input]
    # Without recomputation every block keeps far more than its input.
    kept = _saved_by_scope("none")
    for scope in blocks:
        kept_bytes = sum(np.prod(value.aval.shape) * F32 for value in kept[scope])
        assert kept_bytes > 10 * np.prod(block_input) * F32, scope


def _structure(program) -> list[tuple]:
    """Each op's primitive, scope, phase, result types and operands (by the op and result
    that made each, the step's input, or a constant's type)."""
    made = {value: ("input", i) for i, value in enumerate(program.inputs)}
    ops = []
    for op in program.ops:
        operands = tuple(
            made[atom] if isinstance(atom, Value) else ("constant", str(atom.aval))
            for atom in op.inputs
        )
        results = [str(value.aval) for value in op.outputs]
        ops.append((op.primitive, op.name_stack, op.phase, results, operands))
        made.update({value: (op.index, i) for i, value in enumerate(op.outputs)})
    return ops


def test_identical_blocks_are_traced_once_into_the_same_program(monkeypatch):
    each = config("plain", recompute="layer")
    mesh = build_mesh(each.parallel, devices(each))
    traced = []
    plain = recompute.plain_call

    def counted(block, index, *args):
        traced.append(type(block).__name__)
        return plain(block, index, *args)

    monkeypatch.setattr(recompute, "plain_call", counted)
    recompute._plain_run.cache_clear()  # JAX's traces of earlier tests' blocks aside
    shared, _ = capture_train_step(resolve(each, mesh))
    # 4 layers, dense and MoE in turn, in 2 microbatches: one trace of each kind of block.
    assert sorted(traced) == ["Block", "Block"] and each.model.num_layers * MICROBATCHES == 8
    # Each block traced on its own (a new function for each call) makes the same program.
    traced.clear()
    monkeypatch.setattr(recompute, "_plain_run", recompute._plain_run.__wrapped__)
    own, _ = capture_train_step(resolve(each, mesh))
    assert len(traced) == 8
    assert _structure(shared) == _structure(own)
