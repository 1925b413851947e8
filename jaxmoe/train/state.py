"""The training state: what it holds, its shapes and specs, and its initialisation.

Everything here reads a resolved :class:`~jaxmoe.train.resolved.Run` (the specs, the
pipeline's stage layout, the ZeRO layout, the gradient synchronisation and the optimizer it
holds), except :func:`gather_dtypes` and the model's shapes
(:func:`~jaxmoe.layers.shapes.abstract_model`), which the resolution itself reads. Under a
pipeline (``parallel.pipeline`` > 1) the state holds the blocks' parameters, and everything
shaped like them, stacked by stage (:mod:`jaxmoe.pipeline.params`); ``Run.model_specs``
stays the model's own layout."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.extend.core
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxmoe.config import Config, ModelConfig, MoEConfig
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.layers import GPTMoE
from jaxmoe.layers.shapes import abstract_model, split_model
from jaxmoe.pipeline.params import stacked_specs, to_layout
from jaxmoe.placement.replicas import static_placement

if TYPE_CHECKING:
    from jaxmoe.train.resolved import Run


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


def build_model(config: Config, experimental: ExperimentalOptions = DEFAULT) -> GPTMoE:
    """The model of ``config``, its MoE layers built with the research options
    ``experimental`` (:mod:`jaxmoe.experimental`)."""
    rngs = nnx.Rngs(config.train.seed)
    return GPTMoE(
        config.model,
        config.moe,
        rngs=rngs,
        experimental=experimental,
        context_exchange=config.parallel.context_exchange,
    )


def pure_model_state(model_state: nnx.State) -> Any:
    """The pure dict of the model state, or None when the model has none."""
    pure = nnx.to_pure_dict(model_state)
    return pure if jax.tree.leaves(pure) else None


@functools.lru_cache(maxsize=16)
def gather_dtypes(model: ModelConfig, moe: MoEConfig, seed: int) -> Any:
    """For each parameter, the dtype ZeRO gathers it in (a name): the compute dtype where
    the forward pass reads the parameter once, through a cast to that dtype (so gathering
    the cast shards gives the model the very values it computes with, and the gradient is
    the cast cotangent, as in the plain step), else the parameter's own dtype (a norm's
    scale or the router's kernel, which compute in float32; a tied embedding, read twice).

    Read from the jaxpr of the model's forward pass on one device, traced on abstract
    parameters (nothing is allocated)."""
    graphdef, abstract_params, abstract_model_state = abstract_model(
        model, moe, seed, DEFAULT, "ring"
    )
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


def _initial_model(run: Run) -> tuple[Any, Any]:
    """The model's parameters and its other state (:func:`split_model`), as pure dicts."""
    _, params, model_state = split_model(build_model(run.config, run.experimental))
    return nnx.to_pure_dict(params), pure_model_state(model_state)


def _initial_state(run: Run) -> TrainState:
    return train_state_around(run, *_initial_model(run))


def train_state_around(run: Run, params: Any, model_state: Any = None) -> TrainState:
    """The initial train state around ``params`` and ``model_state`` (pure dicts, in the
    model's layout; under a pipeline the state stacks the blocks by stage)."""
    params = to_layout(params, None, run.stages)
    return _state_around_laid_out(run, params, model_state, run.optimizer.init(params))


def _state_around_laid_out(run: Run, params: Any, model_state: Any, opt_state: Any) -> TrainState:
    """The initial train state around parameters laid out as the state holds them and the
    optimizer's initial state for them."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        grad_sync=run.grad_sync.init_state(params, _param_specs(run), run.axis_sizes),
        placement=initial_placement(run.config),
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


def abstract_state(run: Run) -> TrainState:
    """Shapes and dtypes of the state, computed without allocating it (``Run.state_shapes``)."""
    config = run.config
    _, abstract_params, abstract_model_state = abstract_model(
        config.model,
        config.moe,
        config.train.seed,
        run.experimental,
        config.parallel.context_exchange,
    )
    params = nnx.to_pure_dict(abstract_params)
    model_state = pure_model_state(abstract_model_state)
    # The parameters as the state lays them out, and the optimizer's state for them, depend
    # on the parameters' shapes, the stages and the training configuration (from which
    # resolve builds the optimizer) alone: the same for every data, tensor and expert
    # layout of one model, of which the planner resolves hundreds.
    laid_out = _derived_shapes(
        ("laid out", run.stages), lambda p: to_layout(p, None, run.stages), params
    )
    opt_state = _derived_shapes(("optimizer", run.config.train), run.optimizer.init, laid_out)
    return jax.eval_shape(
        lambda p, m, o: _state_around_laid_out(run, p, m, o), laid_out, model_state, opt_state
    )


# Shapes derived from shapes (:func:`_derived_shapes`), by what derived them and from what;
# the oldest are dropped past the bound.
_DERIVED_SHAPES: dict[tuple, Any] = {}
_DERIVED_SHAPES_KEPT = 64


def _derived_shapes(derivation: Hashable, function: Callable[[Any], Any], tree: Any) -> Any:
    """``jax.eval_shape(function, tree)``, derived once for each ``derivation`` (which
    determines ``function``) and each structure, shapes and dtypes of ``tree``."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple((tuple(leaf.shape), jnp.dtype(leaf.dtype), leaf.weak_type) for leaf in leaves)
    key = (derivation, treedef, shapes)
    found = _DERIVED_SHAPES.pop(key, None)
    if found is None:
        found = jax.eval_shape(function, tree)
    _DERIVED_SHAPES[key] = found  # the newest last
    while len(_DERIVED_SHAPES) > _DERIVED_SHAPES_KEPT:
        del _DERIVED_SHAPES[next(iter(_DERIVED_SHAPES))]
    return found


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


def _param_specs(run: Run) -> Any:
    """The specs of the state's parameters: the model's, under ZeRO their shards'
    (:mod:`jaxmoe.parallel.zero`), under a pipeline the stacked blocks'
    (:func:`~jaxmoe.pipeline.params.stacked_specs`)."""
    if run.zero is not None:
        return run.zero.specs
    return run.model_specs if run.stages is None else stacked_specs(run.model_specs, run.stages)


def state_specs(run: Run) -> TrainState:
    """PartitionSpecs of the whole state (``Run.specs``): optimizer moments follow their
    parameters (under ``train.zero``, the parameters' shards)."""
    specs = _param_specs(run)
    shapes = run.state_shapes
    opt_specs = optax.tree_map_params(
        run.optimizer,
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
        grad_sync=run.grad_sync.state_specs(specs, run.axis_sizes),
        placement=PartitionSpec() if run.config.replica_slots else None,
        model_state=jax.tree.map(lambda _: PartitionSpec(), shapes.model_state),
    )


def abstract_sharded_state(run: Run) -> TrainState:
    """Shapes, dtypes and shardings on the run's mesh of the whole state; nothing is
    allocated."""
    mesh = run.on_mesh
    return jax.tree.map(
        lambda shape, spec: jax.ShapeDtypeStruct(
            shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec)
        ),
        run.state_shapes,
        run.specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


# A model whose parameters (and expert biases) take at most this many bytes is initialised
# on one device and then laid out (:func:`init_train_state`).
ONE_DEVICE_INIT_BYTES = 1 << 30


def init_train_state(run: Run, *, one_device_bytes: int = ONE_DEVICE_INIT_BYTES) -> TrainState:
    """The initial state, laid out on the run's mesh as ``Run.specs`` says.

    The values do not depend on the mesh: the same seed gives the same model on one device
    or on many (JAX's partitionable threefry draws each element from its index alone).
    So a model of at most ``one_device_bytes`` of parameters, on a mesh of this process's
    devices, is drawn by one program on the mesh's first device, the same program under
    every layout, ZeRO stage, pipeline and optimizer (compiled once, however many layouts
    a process or the persistent compilation cache sees), and laid out after; the optimizer
    and gradient-sync state around it are a second, small program in the run's layout.
    A larger model, or a mesh across processes, is initialised directly in its sharded
    layout: no device ever holds more than its shards.
    """
    shardings = _shardings(run.on_mesh, run.specs)
    devices = run.on_mesh.devices.flat
    shapes = run.state_shapes
    model_bytes = sum(
        leaf.size * jnp.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves((shapes.params, shapes.model_state))
    )
    local = all(device.process_index == jax.process_index() for device in devices)
    if model_bytes > one_device_bytes or not local:
        return jax.jit(lambda: _initial_state(run), out_shardings=shardings)()
    params, model_state = jax.jit(
        lambda: _initial_model(run), out_shardings=SingleDeviceSharding(devices[0])
    )()
    params = jax.device_put(params, _shardings(run.on_mesh, run.model_specs))
    model_state = jax.device_put(model_state, shardings.model_state)
    return jax.jit(lambda p, m: train_state_around(run, p, m), out_shardings=shardings)(
        params, model_state
    )


def _shardings(mesh: Any, specs: Any) -> Any:
    """``specs`` as shardings on ``mesh``."""
    is_spec = lambda x: isinstance(x, PartitionSpec)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=is_spec)
