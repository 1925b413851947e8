"""Random token batches placed on a mesh, the compiled train step of a configuration, and a
short training run on them, shared by the train-step tests."""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxmoe.config import Config, ScheduleConfig
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import scheduled_train_step
from jaxmoe.train.state import init_train_state


def random_batch(rng: np.random.Generator, config: Config, mesh: Mesh) -> jax.Array:
    """``[batch, seq_len + 1]`` byte tokens, sharded over the token axes."""
    rows = rng.integers(0, 256, (config.train.batch_size, config.model.seq_len + 1))
    return jax.device_put(rows.astype(np.int32), NamedSharding(mesh, token_spec(mesh)))


def compiled_step(
    config: Config, devices: Sequence[jax.Device] | None = None, experimental=None
) -> tuple[Mesh, Callable]:
    """The mesh of ``config`` and its train step for ``config.schedule`` (and the research
    options ``experimental``), compiled ahead of time: ``(state, batch) -> (state, metrics)``.

    Compiled once per configuration and test process: tests in several modules train the
    same configuration (most often its unscheduled step, the reference of a schedule). The
    plain step does not depend on the schedule section, so all plain steps of a model
    share one compilation."""
    own_transport = experimental is not None and experimental.transport is not None
    if config.schedule.name == "none" and not own_transport:
        config = dataclasses.replace(config, schedule=ScheduleConfig(name="none"))
        experimental = None
    return _compiled_step(config, None if devices is None else tuple(devices), experimental)


# A few steps are shared across modules; more would keep their executables mapped.
@functools.lru_cache(maxsize=8)
def _compiled_step(config: Config, devices: tuple[jax.Device, ...] | None, experimental):
    mesh = build_mesh(config.parallel, devices)
    return mesh, scheduled_train_step(resolve(config, mesh), experimental).compile()


def train_steps(config: Config, devices=None, steps: int | None = None) -> tuple[list, dict]:
    """``steps`` (default ``config.train.steps``) steps on random batches from seed 0: each
    step's metrics and the final parameters, on the host."""
    mesh, step = compiled_step(config, devices)
    state = init_train_state(resolve(config, mesh))
    rng = np.random.default_rng(0)
    history = []
    for _ in range(config.train.steps if steps is None else steps):
        state, metrics = step(state, random_batch(rng, config, mesh))
        history.append(jax.device_get(metrics))
    return history, jax.device_get(state.params)
