"""The resolved run: every plan a configuration determines is derived once.

A run is prepared (mesh, automatic choices, resolution), and then everything below the
command line builds from it: the initial state's shapes and specs, the train step (traced
to the program the scheduler sees), the evaluation step, the sharded state a checkpoint
restores into. Each derivation is counted wherever it is called from: a module that
derived a plan again from the configuration would count twice."""

import sys
from collections import Counter

import pytest

from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.parallel.weights import GatheredOnce, GatheredPerBlock, Weights
from jaxmoe.parallel.zero import ZeroSync
from jaxmoe.prepare import prepare_run
from jaxmoe.train import resolved
from jaxmoe.train.scheduled import capture_train_step
from jaxmoe.train.state import abstract_sharded_state
from jaxmoe.train.step import build_eval_step

SMALL = ["--preset", "tiny", "--model.num_layers", "2", "--model.d_model", "64"]
# The derivations of resolve(), by the name their modules import them under.
DERIVATIONS = (
    "build_mesh",
    "resolve_grad_sync",
    "stage_layout",
    "pipeline_model",
    "zero_layout",
    "weights_for",
    "make_grad_sync",
    "make_optimizer",
    "learning_rate_fn",
    "abstract_state",
    "state_specs",
)
CASES = {
    # ZeRO-1 on a 2-stage pipeline: a stacked plan from two (the whole mesh's and a stage's).
    "pipeline-zero1": (
        "--parallel.pipeline 2 --parallel.expert 4 --train.microbatches 2 --model.moe_every 1 "
        "--train.zero 1",
        {"zero_layout": 2, "make_grad_sync": 0},
        GatheredOnce,
    ),
    "zero3": (
        "--parallel.expert 8 --train.zero 3",
        {"stage_layout": 1, "pipeline_model": 0, "zero_layout": 1, "make_grad_sync": 0},
        GatheredPerBlock,
    ),
    "int8": (
        "--parallel.data 2 --parallel.expert 4 --train.grad_sync int8",
        {"pipeline_model": 0, "zero_layout": 0},
        Weights,
    ),
}


@pytest.fixture
def counts(monkeypatch) -> Counter:
    """Each derivation replaced, in every jaxmoe module that holds it, by one that counts."""
    counted: Counter = Counter()
    for name in DERIVATIONS:
        holders = [
            module
            for module_name, module in list(sys.modules.items())
            if module_name.startswith("jaxmoe") and callable(getattr(module, name, None))
        ]
        original = getattr(holders[0], name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counted[_name] += 1
            return _original(*args, **kwargs)

        for module in holders:
            if getattr(module, name) is original:
                monkeypatch.setattr(module, name, counting)
    return counted


@pytest.mark.parametrize("case", CASES)
def test_a_run_derives_each_plan_once(case, counts):
    flags, expected, weights = CASES[case]
    run = prepare_run(config_from_train_args([*SMALL, *flags.split()]))
    capture_train_step(run)
    build_eval_step(run)
    abstract_sharded_state(run)
    assert run.specs is run.specs and run.state_shapes is run.state_shapes
    assert dict(counts) == {
        name: expected.get(name, 1) for name in DERIVATIONS if expected.get(name, 1)
    }
    assert type(run.weights) is weights
    assert isinstance(run.grad_sync, ZeroSync) == (run.zero is not None)


def test_a_run_without_a_mesh_builds_shapes_but_no_step():
    run = resolved.resolve(config_from_train_args(SMALL))
    assert run.state_shapes.params
    with pytest.raises(ValueError, match="without a mesh"):
        capture_train_step(run)


def test_an_experiments_research_options_reach_the_moe_layers_the_run_builds():
    """``resolve(..., experimental=...)``: the Run's model splits the ragged dispatch's rows
    over an expert's copies as the options say; a configuration they do not apply to is
    refused in one line."""
    from flax import nnx

    from jaxmoe.config import ConfigError
    from jaxmoe.experimental import ExperimentalOptions
    from jaxmoe.layers.replicated import round_robin_slots
    from jaxmoe.placement.copy_split import balanced_slots
    from jaxmoe.train.state import abstract_model

    ragged = [*SMALL, "--moe.capacity_factor", "none", "--moe.dropless_dispatch", "ragged"]
    config = config_from_train_args(ragged)
    round_robin = ExperimentalOptions(replica_split="round_robin")
    cases = ((ExperimentalOptions(), balanced_slots), (round_robin, round_robin_slots))
    for options, split in cases:
        run = resolved.resolve(config, experimental=options)
        assert run.experimental == options
        _, params, model_state = abstract_model(
            config.model, config.moe, config.train.seed, options, "ring"
        )
        model = nnx.merge(run.graphdef, params, model_state)
        layers = [block.ffn for block in model.blocks if block.is_moe]
        assert layers and all(layer.replica_dispatcher.split is split for layer in layers)
    with pytest.raises(ConfigError, match="dropless_dispatch ragged") as error:
        resolved.resolve(config_from_train_args(SMALL), experimental=round_robin)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case", CASES)
def test_a_run_traces_its_model_once(case, monkeypatch):
    """The model's structure and shapes are traced once for everything a run reads of them:
    its resolution, its state's shapes, the dtypes ZeRO gathers in and a pipeline's stages
    (a seed of each case's own: no other test's or case's model is kept)."""
    from jaxmoe.layers import shapes

    built = []
    model = shapes.GPTMoE
    monkeypatch.setattr(shapes, "GPTMoE", lambda *args, **kw: built.append(1) or model(*args, **kw))
    seed = 9173 + list(CASES).index(case)
    flags = [*SMALL, *CASES[case][0].split(), "--train.seed", str(seed)]
    run = prepare_run(config_from_train_args(flags))
    capture_train_step(run)
    abstract_sharded_state(run)
    assert len(built) == 1


@pytest.mark.parametrize("case", CASES)
def test_the_state_shapes_are_those_of_the_state_built_whole(case):
    """``Run.state_shapes``, its optimizer state derived once for its parameters' shapes,
    is the initial state built around the parameters, leaf for leaf (a pipeline's stacked
    blocks, ZeRO's shards, int8's residuals)."""
    import jax
    from flax import nnx

    from jaxmoe.train.state import abstract_model, pure_model_state, train_state_around

    run = resolved.resolve(config_from_train_args([*SMALL, *CASES[case][0].split()]))
    config = run.config
    _, params, model_state = abstract_model(
        config.model,
        config.moe,
        config.train.seed,
        run.experimental,
        config.parallel.context_exchange,
    )
    whole = jax.eval_shape(
        lambda p, m: train_state_around(run, p, m),
        nnx.to_pure_dict(params),
        pure_model_state(model_state),
    )

    def leaves(tree):
        return [(leaf.shape, leaf.dtype, leaf.weak_type) for leaf in jax.tree.leaves(tree)]

    assert jax.tree.structure(run.state_shapes) == jax.tree.structure(whole)
    assert leaves(run.state_shapes) == leaves(whole)


def test_the_optimizer_state_is_derived_once_for_every_layout_of_a_model(monkeypatch):
    """The parameters as the state lays them out and the optimizer's state depend on the
    parameters' shapes alone: the layouts of one model share one derivation of each (the
    planner resolves hundreds), a deeper model has its own."""
    from jaxmoe.train import state

    monkeypatch.setattr(state, "_DERIVED_SHAPES", {})
    layouts = (
        "--parallel.expert 8",
        "--parallel.data 2 --parallel.expert 4",
        "--parallel.data 4 --parallel.tensor 2 --parallel.expert 2",
    )
    shapes = [
        resolved.resolve(config_from_train_args([*SMALL, *flags.split()])).state_shapes
        for flags in layouts
    ]
    derived = [key[0][0] for key in state._DERIVED_SHAPES]
    assert sorted(derived) == ["laid out", "optimizer"]
    assert all(s.opt_state == shapes[0].opt_state for s in shapes)
    deeper = config_from_train_args([*SMALL, "--model.num_layers", "3"])
    assert resolved.resolve(deeper).state_shapes.opt_state != shapes[0].opt_state
    assert len(state._DERIVED_SHAPES) == 4
