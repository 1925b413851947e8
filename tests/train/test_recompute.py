"""``model.recompute="attention"``: the backward pass recomputes the dense core attention;
the flash cores keep no weights to recompute.

It trains as ``"none"`` does, on the default and a tensor-parallel layout: the
same forward pass (the first loss bit for bit) and the same arithmetic in the
backward pass, which XLA compiles with other fusions (with its CSE pass off the
two are bit for bit), so gradients agree to 1e-5 relative and the updated
parameters within tests/train/test_partitioned.py's tolerances. A scheduled
step with it is bit for bit the unscheduled one (``dw``), or within those
tolerances (``lancet``). The captured step keeps fewer forward values for the
backward pass: at least the ``[batch, heads, seq, seq]`` attention weights of
every layer fewer. The blockwise core keeps as little without recomputing anything
(its backward pass recomputes each tile's scores from the rows' log-sum-exp), and
``"attention"`` leaves it as it is.
"""

import dataclasses
import functools

import chex
import pytest

from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import Config, MoEConfig, ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step
from scheduling import saved_for_backward
from tests.train.runs import with_schedule
from tests.train.test_partitioned import assert_same_training, partitioned
from tests.train.test_scheduled import run, small

LAYOUTS = {
    "2x4": ParallelConfig(data=2, expert=4),
    "tensor2": ParallelConfig(data=2, expert=4, tensor=2),
}
F32 = 4
# The programs are checked on both layouts; the steps (two compiles each) on tensor2 are slow.
STEPS_ON = [
    "2x4",
    pytest.param("tensor2", marks=pytest.mark.slow),
]


def _config(
    layout: str, recompute: str, schedule: str = "none", attention: str = "dense"
) -> Config:
    config = small(LAYOUTS[layout], MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0))
    model = dataclasses.replace(config.model, recompute=recompute, attention=attention)
    return with_schedule(dataclasses.replace(config, model=model), schedule)


@functools.cache
def _run(layout: str, recompute: str, schedule: str = "none", steps: int = 2):
    return run(_config(layout, recompute, schedule), steps=steps)


@functools.cache
def _program(layout: str, recompute: str, attention: str = "dense"):
    config = _config(layout, recompute, attention=attention)
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel)))
    return program


def test_the_flag_sets_the_field():
    assert config_from_train_args(["--model.recompute", "attention"]).model.recompute == "attention"


@pytest.mark.parametrize("layout", STEPS_ON)
def test_recomputing_attention_trains_as_keeping_it(layout):
    result, reference = (_run(layout, recompute, steps=1) for recompute in ("attention", "none"))
    (history, state), (expected_history, expected_state) = result, reference
    # The forward pass is the same computation.
    assert history[0]["loss"] == expected_history[0]["loss"]
    # Adam's first moment after one step is (1 - b1) x the clipped gradient.
    chex.assert_trees_all_close(state.opt_state, expected_state.opt_state, rtol=1e-5, atol=1e-8)
    assert_same_training(result, reference)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layer_recomputes_its_attention_and_nothing_else(layout):
    def recomputed(program) -> list[str]:
        return [op.layer for op in program.ops if "rematted_computation" in op.name_stack]

    layers = recomputed(_program(layout, "attention"))
    assert all("/attention/" in layer for layer in layers)
    assert {layer.split("/")[0] for layer in layers} == {"layer_0", "layer_1"}
    assert recomputed(_program(layout, "none")) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_attention_weights_are_no_longer_saved_for_backward(layout):
    config = _config(layout, "attention")
    model, parallel = config.model, config.parallel
    rows = config.train.batch_size // parallel.batch_shards
    local_heads = model.num_heads // parallel.tensor
    # Each device attends over the whole (gathered) sequence with its own heads.
    weights = rows * local_heads * model.seq_len**2 * F32
    kept = saved_for_backward(_program(layout, "none"))
    recomputed = saved_for_backward(_program(layout, "attention"))
    assert kept.bytes - recomputed.bytes >= model.num_layers * weights
    # The blockwise core keeps no weights either, recomputing nothing.
    flash = _program(layout, "attention", "blockwise")
    assert kept.bytes - saved_for_backward(flash).bytes >= model.num_layers * weights
    assert not any("rematted_computation" in op.name_stack for op in flash.ops)


@pytest.mark.parametrize("layout", STEPS_ON)
def test_the_dw_schedule_is_bit_for_bit_with_recompute(layout):
    # The emitted step keeps the recomputation's barrier, as the plain jit lowers it.
    chex.assert_trees_all_equal(_run(layout, "attention", "dw"), _run(layout, "attention"))


@pytest.mark.parametrize("layout", STEPS_ON)
def test_the_lancet_schedule_matches_with_recompute(layout):
    # Partitioning changes XLA's fusions, hence the tolerances of test_partitioned.
    config = partitioned(_config(layout, "attention"), "lancet", chunks=2)
    assert_same_training(run(config, steps=2), _run(layout, "attention"))
