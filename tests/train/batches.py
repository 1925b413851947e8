"""Random token batches placed on a mesh, and a short training run on them, shared by the
train-step tests."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxmoe.config import Config
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.train.state import init_train_state
from jaxmoe.train.step import build_train_step


def random_batch(rng: np.random.Generator, config: Config, mesh: Mesh) -> jax.Array:
    """``[batch, seq_len + 1]`` byte tokens, sharded over the token axes."""
    rows = rng.integers(0, 256, (config.train.batch_size, config.model.seq_len + 1))
    return jax.device_put(rows.astype(np.int32), NamedSharding(mesh, token_spec(mesh)))


def train_steps(config: Config, devices=None, steps: int | None = None) -> tuple[list, dict]:
    """``steps`` (default ``config.train.steps``) steps on random batches from seed 0: each
    step's metrics and the final parameters, on the host."""
    mesh = build_mesh(config.parallel, devices)
    state = init_train_state(config, mesh)
    step = build_train_step(config, mesh).jit()
    rng = np.random.default_rng(0)
    history = []
    for _ in range(config.train.steps if steps is None else steps):
        state, metrics = step(state, random_batch(rng, config, mesh))
        history.append(jax.device_get(metrics))
    return history, jax.device_get(state.params)
