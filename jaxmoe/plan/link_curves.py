"""Measured link curves: collectives timed on the mesh, fitted for the cost model.

Times ``all_to_all`` over the ``expert`` axis and ``psum`` over ``data``,
``expert`` and both, at operand sizes from ``min_bytes`` to ``max_bytes`` (each 4x
the last), and fits :class:`scheduling.CollectiveCurves`, which
``--schedule.link_curves`` and ``train.grad_sync auto`` then use instead of the
profile's link figures.

Each sample is what one more collective adds: ``chain`` collectives in one program,
each fed by the result of the one before (so that XLA can neither merge nor reorder
them), against a single one. The launch of the program, which a step pays once and
not once per collective, cancels out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import scheduling
from jaxmoe.parallel.mesh import DATA_AXIS, EXPERT_AXIS
from jaxmoe.parallel.timing import time_per_device


def _sizes(min_bytes: int, max_bytes: int) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def _collective(kind: str, axes: tuple[str, ...], group: int):
    def run(x: jax.Array) -> jax.Array:
        if kind == "all_to_all":
            return jnp.sum(jax.lax.all_to_all(x.reshape(group, -1), axes[0], 0, 0))
        return jnp.sum(jax.lax.psum(x, axes))

    return run


def _seconds_per_collective(
    mesh: Mesh, collective, elements: int, repeats: int, chain: int
) -> list[float]:
    def chained(copies: int) -> list[float]:
        def per_device(seed):
            for _ in range(copies):
                # The operand depends on the previous result: no merging, no reordering.
                seed = collective(jnp.full((elements,), seed, jnp.float32)) * 1e-9
            return seed

        return time_per_device(per_device, mesh, warmup=1, repeats=repeats)

    single, several = chained(1), chained(chain)
    pairs = zip(sorted(single), sorted(several), strict=True)
    return [max(m - s, 1e-6) / (chain - 1) for s, m in pairs]


def measure_link_curves(
    mesh: Mesh,
    *,
    source: str,
    min_bytes: int = 4096,
    max_bytes: int = 4 << 20,
    repeats: int = 5,
    chain: int = 4,
) -> scheduling.CollectiveCurves:
    """The fitted curves of ``mesh``'s collectives (every process must call this)."""
    if chain < 2:
        raise ValueError(f"chain={chain}: time at least 2 collectives per program")
    cases: list[tuple[str, tuple[str, ...]]] = [("all_to_all", (EXPERT_AXIS,))]
    cases += [("psum", axes) for axes in ((DATA_AXIS,), (EXPERT_AXIS,), (DATA_AXIS, EXPERT_AXIS))]
    curves = scheduling.CollectiveCurves(source=source)
    for kind, axes in cases:
        group = 1
        for axis in axes:
            group *= mesh.shape[axis]
        if group == 1:
            continue
        collective = _collective(kind, axes, group)
        samples = []
        for nbytes in _sizes(min_bytes, max_bytes):
            elements = max(group, nbytes // 4 // group * group)
            seconds = _seconds_per_collective(mesh, collective, elements, repeats, chain)
            samples += [(elements * 4, s) for s in seconds]
        curves.curves[(kind, group)] = scheduling.PiecewiseLinear.fit(samples)
    return curves


def describe(curves: scheduling.CollectiveCurves) -> str:
    """One line per curve: its points in KiB and milliseconds."""
    lines = []
    for (kind, group), curve in sorted(curves.curves.items()):
        points = ", ".join(
            f"{int(b) >> 10} KiB {s * 1e3:.2f} ms"
            for b, s in zip(curve.sizes, curve.seconds, strict=True)
        )
        lines.append(f"{kind} over {group}: {points}")
    return "\n".join(lines)
