"""The resolved run: what a configuration determines, derived once.

:func:`resolve` derives from a :class:`~jaxmoe.config.Config` (and the mesh it runs on,
where there is one) everything the step, the state, its checkpoints and the planner's
estimates are built from: the model's structure and parameter specs, the pipeline (its
stage layout and tick table), the ZeRO layout and how the step reads its parameters under
it, the gradient synchronisation, the optimizer, the scheduling policy, and the state's
specs and shapes. Each is derived here and nowhere else; everything below the command line
receives the :class:`Run` (:func:`jaxmoe.prepare.prepare_run` builds the one a run trains
with, its mesh built and its automatic choices made first).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

import scheduling
from jaxmoe.config import Config
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.parallel.grad_sync import GradSync, make_grad_sync
from jaxmoe.parallel.grad_sync.reduce_dtype import ReducedIn
from jaxmoe.parallel.mesh import mesh_axis_sizes
from jaxmoe.parallel.sharding import param_specs
from jaxmoe.parallel.weights import Weights, weights_for
from jaxmoe.parallel.zero import ZeroLayout, ZeroSync, zero_layout
from jaxmoe.pipeline.model import PipelineModel, pipeline_model
from jaxmoe.pipeline.params import PIPELINE_AXIS, StageLayout, stacked_zero_layout, stage_layout
from jaxmoe.train import state
from jaxmoe.train.optimizer import learning_rate_fn, make_optimizer

PyTree = Any


@dataclass(frozen=True, eq=False)
class Run:
    """A configuration with everything it determines derived (see the module docstring)."""

    config: Config
    # The mesh the run's steps are built for (None: shapes and estimates only).
    mesh: Mesh | None
    axis_sizes: Mapping[str, int]  # mesh axis -> size, in mesh order
    graphdef: nnx.GraphDef  # the model's structure
    model_specs: PyTree  # the model's parameter specs (before ZeRO or a pipeline)
    pipeline: PipelineModel | None  # the model cut for ``parallel.pipeline`` (None: none)
    zero: ZeroLayout | None  # where each parameter's shards lie (None: no ZeRO)
    weights: Weights  # how the step reads the state's parameters
    grad_sync: GradSync  # how the step synchronises the gradients
    optimizer: optax.GradientTransformation
    learning_rate: optax.Schedule
    policy: scheduling.SchedulePolicy  # the schedule section, with the run's op-cost cache
    # What train.grad_sync auto chose and why (a plan.grad_sync_choice.GradSyncChoice), or
    # None when the configuration named an algorithm.
    grad_sync_choice: Any = None
    # Research options of the model and its placement (jaxmoe.experimental): what the
    # model's MoE layers were built with, and what the placement planner reads.
    experimental: ExperimentalOptions = DEFAULT

    @property
    def stages(self) -> StageLayout | None:
        """The chunks of the blocks over the pipeline's stages (None without a pipeline)."""
        return None if self.pipeline is None else self.pipeline.layout

    @property
    def param_specs(self) -> PyTree:
        """The specs of what the optimizer updates: the parameters (a pipeline's blocks
        stacked by stage), or under ZeRO their shards."""
        return self.specs.params

    @functools.cached_property
    def state_shapes(self) -> state.TrainState:
        """Shapes and dtypes of the train state; nothing is allocated."""
        return state.abstract_state(self)

    @functools.cached_property
    def specs(self) -> state.TrainState:
        """PartitionSpecs of the whole train state."""
        return state.state_specs(self)

    @property
    def on_mesh(self) -> Mesh:
        """The mesh, which building a step or a state needs."""
        if self.mesh is None:
            raise ValueError("this run was resolved without a mesh: resolve(config, mesh)")
        return self.mesh


def resolve(
    config: Config,
    mesh: Mesh | None = None,
    grad_sync_choice: Any = None,
    experimental: ExperimentalOptions = DEFAULT,
) -> Run:
    """Everything ``config`` determines, on ``mesh`` (see the module docstring). The
    configuration's automatic choices must be made already (``train.grad_sync auto``:
    :func:`jaxmoe.prepare.prepare_run`). ``experimental``: research options, which an
    experiment passes (:mod:`jaxmoe.experimental`; the defaults change nothing)."""
    experimental.check(config.moe)
    axes = mesh_axis_sizes(config.parallel)
    graphdef, abstract_params, _ = state.abstract_model(
        config.model,
        config.moe,
        config.train.seed,
        experimental,
        config.parallel.context_exchange,
    )
    model_specs = param_specs(abstract_params, axes)
    stages = stage_layout(config.parallel, config.model.num_layers)
    pipeline = None if stages is None else pipeline_model(config, stages, experimental)
    zero = _zero_layout(config, abstract_params, model_specs, axes, stages)
    grad_sync = (
        make_grad_sync(config.train, mesh)
        if zero is None
        else ZeroSync(zero, config.train.grad_sync, config.train.grad_bucket_bytes)
    )
    if config.train.grad_reduce_dtype != "float32":
        grad_sync = ReducedIn(grad_sync, jnp.dtype(config.train.grad_reduce_dtype))
    learning_rate = learning_rate_fn(config.train)
    return Run(
        config=config,
        mesh=mesh,
        axis_sizes=axes,
        graphdef=graphdef,
        model_specs=model_specs,
        pipeline=pipeline,
        zero=zero,
        weights=weights_for(zero),
        grad_sync=grad_sync,
        optimizer=make_optimizer(config.train, learning_rate),
        learning_rate=learning_rate,
        policy=schedule_policy(config),
        grad_sync_choice=grad_sync_choice,
        experimental=experimental,
    )


def op_cost_cache() -> Path:
    """Where measured op costs are kept between runs: ``$XDG_CACHE_HOME/jaxmoe``."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "jaxmoe"


def schedule_policy(config: Config) -> scheduling.SchedulePolicy:
    """The scheduling policy of ``config.schedule``, measured op costs kept in the cache."""
    return dataclasses.replace(config.schedule, op_cost_cache=str(op_cost_cache()))


def _zero_layout(
    config: Config,
    abstract_params: nnx.State,
    model_specs: PyTree,
    axes: Mapping[str, int],
    stages: StageLayout | None,
) -> ZeroLayout | None:
    """Where each parameter's shards lie under ``train.zero`` (None without ZeRO):
    :mod:`jaxmoe.parallel.zero`; under a pipeline, the stacked blocks'."""
    if not config.train.zero:
        return None
    shapes = nnx.to_pure_dict(abstract_params)
    dtypes = state.gather_dtypes(config.model, config.moe, config.train.seed)
    # Stage 3 reduce-scatters each block's gradients inside the backward pass, where its
    # gathers are differentiated: in train.grad_reduce_dtype there (the other stages' sums
    # are cast around their gradient sync: ReducedIn).
    reduce_dtype = config.train.grad_reduce_dtype if config.train.zero == 3 else None
    plan = zero_layout(config.train.zero, shapes, model_specs, axes, dtypes, reduce_dtype)
    if stages is None:
        return plan
    # A stacked block is split over the pipeline axis by stage: its layers are sharded
    # over their replicas within a stage.
    within_stage = zero_layout(
        config.train.zero, shapes, model_specs, {**axes, PIPELINE_AXIS: 1}, dtypes
    )
    return stacked_zero_layout(plan, within_stage, stages)
