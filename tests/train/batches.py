"""Random token batches placed on a mesh, shared by the train-step tests."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxmoe.config import Config
from jaxmoe.parallel import token_spec


def random_batch(rng: np.random.Generator, config: Config, mesh: Mesh) -> jax.Array:
    """``[batch, seq_len + 1]`` byte tokens, sharded over the token axes."""
    rows = rng.integers(0, 256, (config.train.batch_size, config.model.seq_len + 1))
    return jax.device_put(rows.astype(np.int32), NamedSharding(mesh, token_spec(mesh)))
