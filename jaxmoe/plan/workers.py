"""The planner's traces on worker processes: screens and estimates of mapped configurations
taken ``jobs`` at a time (``jaxmoe plan --jobs``).

A trace is Python work in JAX's tracer, one core's worth, so a plan on a many-core host
runs its traces side by side in processes of their own. Each worker keeps a
:class:`~jaxmoe.plan.tracer.Tracer` of its own, and a mapping's work always goes to the
same worker (chosen by its layout), so the one-block trace of a mapping's screen is still
the first of its estimate's two. Configurations, screens and estimates travel pickled
(frozen dataclasses), and a worker computes exactly what the planner's own tracer
computes: the ranking does not depend on ``jobs``.

Workers are started with ``spawn`` (JAX is not safe to fork once imported) and inherit the
environment, so they trace for the same backend as the planner; they are told not to
preallocate accelerator memory, since they trace on abstract meshes and run nothing.
This module imports no JAX at its top: a worker loads JAX once its environment is set.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxmoe.config import Config

# Set in each worker by _start.
_TRACER: Any = None
_EXTRAPOLATE = True


def _start(
    schedules: tuple[str, ...],
    profile: str,
    cache_dir: str | None,
    extrapolate: bool,
    memory_limit: int | None,
):
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    from jaxmoe.plan.collector import collect_less
    from jaxmoe.plan.estimates import EstimateCache
    from jaxmoe.plan.tracer import Tracer

    global _TRACER, _EXTRAPOLATE
    _TRACER = Tracer(
        schedules,
        profile,
        EstimateCache(None if cache_dir is None else Path(cache_dir)),
        memory_limit,
    )
    _EXTRAPOLATE = extrapolate
    collect_less()


def _screen(config: Config) -> Any:
    return _TRACER.screen(config, _EXTRAPOLATE)


def _estimate(config: Config) -> Any:
    from jaxmoe.plan.tracer import estimate_mapping

    return estimate_mapping(
        config,
        _TRACER.schedules,
        _TRACER.profile,
        _TRACER.cache,
        extrapolate_layers=_EXTRAPOLATE,
        tracer=_TRACER,
    )


def _shut_down(workers: list[concurrent.futures.ProcessPoolExecutor]) -> None:
    for worker in workers:
        worker.shutdown(cancel_futures=True)


@dataclass(frozen=True)
class Work:
    """A screen (``"screen"``) or an estimate (``"estimate"``) of a mapped configuration;
    ``key`` names its mapping, so that its screen and its estimate share a worker."""

    kind: str
    config: Config
    key: Any


class TracePool:
    """``jobs`` worker processes, each tracing and pricing as a planner's
    :class:`~jaxmoe.plan.tracer.Tracer` would (module docstring), started when first
    given work."""

    def __init__(
        self,
        jobs: int,
        schedules: Sequence[str],
        profile: str,
        cache_dir: Path | None,
        extrapolate_layers: bool,
        memory_limit: int | None = None,
    ):
        if jobs < 2:
            raise ValueError(f"jobs={jobs}: a pool has two workers or more")
        self.jobs = jobs
        self._start = (
            tuple(schedules),
            profile,
            None if cache_dir is None else str(cache_dir),
            extrapolate_layers,
            memory_limit,
        )
        self._workers: list[concurrent.futures.ProcessPoolExecutor] = []
        self._affinity: dict[Any, int] = {}  # a mapping's key -> the worker that traced it
        self._stop: weakref.finalize | None = None

    def close(self) -> None:
        """Stop the workers (work not begun is dropped); also done when the pool is
        collected, e.g. after a plan raised."""
        if self._stop is not None:
            self._stop()
        self._workers, self._stop = [], None

    def _started(self) -> list[concurrent.futures.ProcessPoolExecutor]:
        if not self._workers:
            context = multiprocessing.get_context("spawn")
            self._workers = [
                concurrent.futures.ProcessPoolExecutor(
                    1, mp_context=context, initializer=_start, initargs=self._start
                )
                for _ in range(self.jobs)
            ]
            self._stop = weakref.finalize(self, _shut_down, self._workers)
        return self._workers

    def run(self, work: Sequence[Work]) -> list[Any]:
        """Each of ``work`` done on a worker, side by side: a
        :class:`~jaxmoe.plan.bounds.Screen` for a screen, ``(memory, times)`` for an
        estimate, in ``work``'s order. A mapping goes to the worker that traced it before
        where that one is not already given other work of this call (then its trace is
        kept there), else to the worker given least."""
        workers = self._started()
        given = [0] * len(workers)
        futures = []
        for item in work:
            index = self._affinity.get(item.key)
            if index is None or given[index]:
                index = min(range(len(workers)), key=given.__getitem__)
            given[index] += 1
            self._affinity[item.key] = index
            task = _screen if item.kind == "screen" else _estimate
            futures.append(workers[index].submit(task, item.config))
        return [future.result() for future in futures]
