"""Timing a per-device program on the whole mesh: compile, warm up, time runs to completion."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec


def time_per_device(
    per_device: Callable[[jax.Array], jax.Array], mesh: Mesh, *, warmup: int, repeats: int
) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``per_device(seed)`` under a whole-mesh
    ``shard_map`` (the seed is a replicated scalar), after ``warmup`` runs."""
    run = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=PartitionSpec(),
            out_specs=PartitionSpec(),
            check_vma=False,
        )
    )
    seed = jnp.float32(1.0)
    for _ in range(warmup):
        jax.block_until_ready(run(seed))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(run(seed))
        seconds.append(time.perf_counter() - started)
    return seconds
