"""The training state, its partition specs, and its initialisation on the mesh.

Under a pipeline (``parallel.pipeline`` > 1) the state holds the blocks' parameters, and
everything shaped like them, stacked by stage (:mod:`jaxmoe.pipeline.params`);
:func:`model_graphdef_and_specs` stays the model's own layout."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig
from jaxmoe.layers import GPTMoE
from jaxmoe.layers.router import ExpertBias
from jaxmoe.parallel.grad_sync import make_grad_sync
from jaxmoe.parallel.mesh import mesh_axis_sizes
from jaxmoe.parallel.sharding import param_specs
from jaxmoe.parallel.zero import ZeroPlan, plan_zero
from jaxmoe.pipeline.params import (
    PIPELINE_AXIS,
    StageLayout,
    stacked_specs,
    stacked_zero_plan,
    stage_layout,
    to_layout,
)
from jaxmoe.placement.replicas import static_placement
from jaxmoe.train.optimizer import make_optimizer


class TrainState(NamedTuple):
    step: Any  # int32 scalar
    params: Any  # pure dict of arrays (``nnx.to_pure_dict`` of the model state)
    opt_state: Any
    # The gradient-sync algorithm's state (``{}`` for stateless ones): residuals, pending
    # gradients. Checkpointed with the rest.
    grad_sync: Any
    # Replica tables [moe_layers, expert_axis, replica_slots] int32 when moe.slots_per_device
    # leaves spare slots (jaxmoe.placement.replicas), else None. Replicated on every device.
    placement: Any = None
    # The model's variables that are not parameters (no gradient, no optimizer state), as a
    # pure dict like ``params``: the routers' expert biases (jaxmoe.layers.router.ExpertBias)
    # under moe.expert_bias_rate > 0, which the step updates from the routed load; else
    # None. Replicated on every device, checkpointed with the rest.
    model_state: Any = None


def build_model(config: Config) -> GPTMoE:
    return GPTMoE(config.model, config.moe, rngs=nnx.Rngs(config.train.seed))


@functools.lru_cache(maxsize=16)
def _abstract_model(
    model: ModelConfig, moe: MoEConfig, seed: int
) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """The model's structure and the shapes of its parameters and of its other state
    (:func:`split_model`), without allocating anything.

    Kept per model: building it traces every initialiser, seconds for a large model, and a
    step's specs and state shapes ask for it many times."""
    return split_model(nnx.eval_shape(lambda: GPTMoE(model, moe, rngs=nnx.Rngs(seed))))


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, params, model_state)``: the trained parameters (every variable but the
    expert biases) and the state the step updates itself (the expert biases). ``nnx.merge(
    graphdef, params, model_state)`` takes their pure dicts."""
    graphdef, model_state, params = nnx.split(model, ExpertBias, ...)
    return graphdef, params, model_state


def pure_model_state(model_state: nnx.State) -> Any:
    """The pure dict of the model state, or None when the model has none."""
    pure = nnx.to_pure_dict(model_state)
    return pure if jax.tree.leaves(pure) else None


def model_graphdef_and_specs(config: Config) -> tuple[nnx.GraphDef, dict]:
    """The model's structure and parameter specs, without allocating parameters."""
    graphdef, abstract_state, _ = _abstract_model(config.model, config.moe, config.train.seed)
    return graphdef, param_specs(abstract_state, mesh_axis_sizes(config.parallel))


def zero_plan(config: Config) -> ZeroPlan | None:
    """Where each parameter's shards lie under ``train.zero`` (None without ZeRO):
    :mod:`jaxmoe.parallel.zero`."""
    if not config.train.zero:
        return None
    return _zero_plan(
        config.model, config.moe, config.parallel, config.train.seed, config.train.zero
    )


@functools.lru_cache(maxsize=16)
def _zero_plan(
    model: ModelConfig, moe: MoEConfig, parallel: ParallelConfig, seed: int, stage: int
) -> ZeroPlan:
    _, abstract_params, _ = _abstract_model(model, moe, seed)
    axes = mesh_axis_sizes(parallel)
    shapes, specs = nnx.to_pure_dict(abstract_params), param_specs(abstract_params, axes)
    dtypes = gather_dtypes(model, moe, seed)
    plan = plan_zero(stage, shapes, specs, axes, dtypes)
    layout = stage_layout(parallel, model.num_layers)
    if layout is None:
        return plan
    # A stacked block is split over the pipeline axis by stage: its layers are sharded
    # over their replicas within a stage.
    within_stage = plan_zero(stage, shapes, specs, {**axes, PIPELINE_AXIS: 1}, dtypes)
    return stacked_zero_plan(plan, within_stage, layout)


@functools.lru_cache(maxsize=16)
def gather_dtypes(model: ModelConfig, moe: MoEConfig, seed: int) -> Any:
    """For each parameter, the dtype ZeRO gathers it in (a name): the compute dtype where
    the forward pass reads the parameter once, through a cast to that dtype (so gathering
    the cast shards gives the model the very values it computes with, and the gradient is
    the cast cotangent, as in the plain step), else the parameter's own dtype (a norm's
    scale or the router's kernel, which compute in float32; a tied embedding, read twice).

    Read from the jaxpr of the model's forward pass on one device, traced on abstract
    parameters (nothing is allocated)."""
    graphdef, abstract_params, abstract_model_state = _abstract_model(model, moe, seed)
    params = nnx.to_pure_dict(abstract_params)
    own = jax.tree.map(lambda leaf: jnp.dtype(leaf.dtype).name, params)
    compute = jnp.dtype(model.dtype)
    if all(jnp.dtype(name) == compute for name in jax.tree.leaves(own)):
        return own
    model_state = pure_model_state(abstract_model_state)
    rows = max(1, (moe.group_size or model.seq_len) // model.seq_len)
    tokens = jax.ShapeDtypeStruct((rows, model.seq_len), jnp.int32)

    def forward(params: Any, model_state: Any, tokens: jax.Array) -> jax.Array:
        states = [params] if model_state is None else [params, model_state]
        return nnx.merge(graphdef, *states)(tokens)[0]

    jaxpr = jax.make_jaxpr(forward)(params, model_state, tokens).jaxpr
    leaves, treedef = jax.tree.flatten(own)
    readers: dict[Any, list[Any]] = {var: [] for var in jaxpr.invars[: len(leaves)]}
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if not isinstance(var, jax.extend.core.Literal) and var in readers:
                readers[var].append(eqn)
    returned = {var for var in jaxpr.outvars if not isinstance(var, jax.extend.core.Literal)}
    chosen = []
    for var, name in zip(jaxpr.invars, leaves, strict=False):
        eqns = readers[var]
        cast_once = (
            len(eqns) == 1
            and var not in returned
            and eqns[0].primitive.name == "convert_element_type"
            and jnp.dtype(eqns[0].params["new_dtype"]) == compute
        )
        chosen.append(compute.name if cast_once else name)
    return jax.tree.unflatten(treedef, chosen)


def _initial_state(config: Config) -> TrainState:
    _, params, model_state = split_model(build_model(config))
    return train_state_around(config, nnx.to_pure_dict(params), pure_model_state(model_state))


def train_state_around(config: Config, params: Any, model_state: Any = None) -> TrainState:
    """The initial train state around ``params`` and ``model_state`` (pure dicts, in the
    model's layout; under a pipeline the state stacks the blocks by stage)."""
    params = to_layout(params, None, pipeline_layout(config))
    opt_state = make_optimizer(config.train).init(params)
    specs = param_state_specs(config)
    grad_sync = make_grad_sync(config.train).init_state(
        params, specs, mesh_axis_sizes(config.parallel)
    )
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        grad_sync=grad_sync,
        placement=initial_placement(config),
        model_state=model_state,
    )


def initial_placement(config: Config) -> jax.Array | None:
    """Every MoE layer starts from the static placement (None without spare slots)."""
    if not config.replica_slots:
        return None
    table = static_placement(
        config.moe.num_experts, config.parallel.expert, config.moe.slots_per_device
    )
    return jnp.tile(jnp.asarray(table), (len(config.model.moe_layers), 1, 1))


def abstract_train_state(config: Config) -> TrainState:
    """Shapes and dtypes of the state, computed without allocating it."""
    _, abstract_params, abstract_model_state = _abstract_model(
        config.model, config.moe, config.train.seed
    )
    params = nnx.to_pure_dict(abstract_params)
    model_state = pure_model_state(abstract_model_state)
    return jax.eval_shape(lambda p, m: train_state_around(config, p, m), params, model_state)


def param_trees_mapped(state: TrainState, convert: Callable[[Any], Any]) -> TrainState:
    """``state`` (or its shapes, or its specs) with ``convert`` applied to what is laid out
    like the parameters: the parameters, the optimizer state, the gradient-sync state. The
    model state (the expert biases, keyed by layer) and the placement keep their layout
    under every pipeline."""
    return state._replace(
        params=convert(state.params),
        opt_state=convert(state.opt_state),
        grad_sync=convert(state.grad_sync),
    )


def pipeline_layout(config: Config) -> StageLayout | None:
    """The chunks of the blocks under ``parallel.pipeline`` (None without a pipeline)."""
    return stage_layout(config.parallel, config.model.num_layers)


def param_state_specs(config: Config) -> Any:
    """The specs of the state's parameters: the model's (:func:`model_graphdef_and_specs`),
    under ``train.zero`` their shards' (:mod:`jaxmoe.parallel.zero`), under a pipeline the
    stacked blocks' (:func:`~jaxmoe.pipeline.params.stacked_specs`)."""
    plan = zero_plan(config)
    if plan is not None:
        return plan.specs
    specs = model_graphdef_and_specs(config)[1]
    layout = pipeline_layout(config)
    return specs if layout is None else stacked_specs(specs, layout)


def state_specs(config: Config) -> TrainState:
    """PartitionSpecs of the whole state: optimizer moments follow their parameters (under
    ``train.zero``, the parameters' shards)."""
    specs = param_state_specs(config)
    shapes = abstract_train_state(config)
    opt_specs = optax.tree_map_params(
        make_optimizer(config.train),
        lambda _, spec: spec,
        shapes.opt_state,
        specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    return TrainState(
        step=PartitionSpec(),
        params=specs,
        opt_state=opt_specs,
        grad_sync=make_grad_sync(config.train).state_specs(specs, mesh_axis_sizes(config.parallel)),
        placement=PartitionSpec() if config.replica_slots else None,
        model_state=jax.tree.map(lambda _: PartitionSpec(), shapes.model_state),
    )


def abstract_sharded_state(config: Config, mesh: Mesh) -> TrainState:
    """Shapes, dtypes and shardings on ``mesh`` of the whole state; nothing is allocated."""
    return jax.tree.map(
        lambda shape, spec: jax.ShapeDtypeStruct(
            shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec)
        ),
        abstract_train_state(config),
        state_specs(config),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def init_train_state(config: Config, mesh: Mesh) -> TrainState:
    """Initialise parameters and optimizer state directly in their sharded layout.

    The values do not depend on the mesh: the same seed gives the same model
    on one device or on many.
    """
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        state_specs(config),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    return jax.jit(lambda: _initial_state(config), out_shardings=shardings)()
