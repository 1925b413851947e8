"""A mapped configuration traced and priced: the traces one plan keeps (:class:`Tracer`),
each traced configuration's memory and simulated step under each schedule, a layout's
bounds from a one-block trace (:mod:`jaxmoe.plan.bounds`), and a mapping's estimate from
one trace or, for a deep model, from two shallow traces extrapolated to its depth
(:func:`estimate_mapping`). The planner (:mod:`jaxmoe.plan.planner`) decides which
mappings get which."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import scheduling
from jaxmoe.config import Config, ConfigError
from jaxmoe.config.choices import DISPATCHERS
from jaxmoe.config.schedule import replace_section
from jaxmoe.parallel.mesh import abstract_mesh
from jaxmoe.plan.bounds import Screen, screen
from jaxmoe.plan.estimates import Estimate, EstimateCache, StepTime
from jaxmoe.plan.layer_extrapolation import (
    TRACED_BLOCKS,
    block_count,
    extrapolate,
    extrapolates,
    line_depths,
    screens_shallow,
    with_blocks,
)
from jaxmoe.plan.memory import StepMemory, step_memory
from jaxmoe.plan.options import options_of
from jaxmoe.plan.state_memory import memory_per_device
from jaxmoe.train.resolved import Run, resolve, schedule_policy
from jaxmoe.train.scheduled import capture_train_step
from jaxmoe.train.step import ShardedStep
from scheduling import (
    Program,
    batch_inputs,
    cost_model,
    gathers_in_flight_bytes,
)


def with_schedule(config: Config, schedule: str, profile: str) -> Config:
    """``config`` scheduled by ``schedule`` on the device profile ``profile``."""
    return dataclasses.replace(
        config, schedule=replace_section(config.schedule, name=schedule, profile=profile)
    )


def applicable_schedules(
    config: Config, schedules: Sequence[str], profile: str
) -> dict[str, Config]:
    """``config`` under each of ``schedules`` that applies to it (``pair`` needs two
    microbatches or a pipeline); refused when none does."""
    found = {}
    for schedule in schedules:
        try:
            found[schedule] = with_schedule(config, schedule, profile)
        except ConfigError:
            continue
    if not found:
        raise ConfigError(
            f"schedules {', '.join(schedules)}: none applies to this mapping "
            f"({config.train.microbatches} microbatch(es), pipeline "
            f"{config.parallel.pipeline}): add none"
        )
    return found


@dataclasses.dataclass(frozen=True)
class Traced:
    """A configuration's per-device step as traced, with what the trace resolved."""

    program: Program
    step: ShardedStep
    run: Run  # its state's shapes were computed for the trace


def trace(config: Config) -> Traced:
    """``config``'s per-device step traced on an abstract mesh of its devices (none are
    needed)."""
    run = resolve(config, abstract_mesh(config.parallel))
    return Traced(*capture_train_step(run), run)


def _estimate_program(
    traced: Traced, memory: StepMemory, config: Config, schedules: Sequence[str], profile: str
) -> tuple[Estimate, dict[str, bool]]:
    """Each schedule's simulated step of the traced step, beside its ``memory``; and
    whether each schedule's live-bytes bound withdrew placements from its order."""
    program, mesh = traced.program, traced.program.mesh
    batch = batch_inputs(program, traced.step.batch_argnums)
    times = {}
    bound_withdrew = {}
    # The schedules differ in their names alone: one model prices the program for all,
    # each op once (the model goes with this estimate).
    cost = None
    for schedule, variant in applicable_schedules(config, schedules, profile).items():
        policy = schedule_policy(variant)
        if cost is None:
            cost = cost_model(policy, mesh, program).priced_once()
        scheduled = scheduling.schedule(program, policy, cost, batch)
        # The step as the search simulated it, and as the schedule report does again (the
        # report itself, with its trace and each collective's story, is not needed here).
        timeline = scheduled.timeline
        times[schedule] = StepTime(
            timeline.step_seconds,
            timeline.compute_seconds,
            timeline.communication_seconds,
            timeline.exposed_communication_seconds,
            gathers_in_flight_bytes(scheduled.graph, scheduled.order.nodes),
        )
        bound_withdrew[schedule] = scheduled.order.withdrawn_for_bound > 0
    return (memory, times), bound_withdrew


# The traced programs a plan keeps: a model of few blocks is screened from its whole trace,
# which its estimate reads again (a deeper model's screen traces one block, its estimate
# its whole depth, or two blocks and three: none is read twice, and the kept programs make
# way in turn). The search estimates mappings in the order of their bounds, so the
# programs that make way are those already estimated, then those whose screens bound their
# mappings highest (estimated last, if ever). At most this many, of at most this many ops
# in all (whole traces of deep models are long).
PROGRAMS_KEPT = 32
OPS_KEPT = 500_000


class Tracer:
    """The traces of one plan: the programs its search reads next (see above), each traced
    configuration's estimate, kept for the plan, and the screens' bounds (a screen of a
    model traced whole is also its estimate)."""

    def __init__(
        self,
        schedules: Sequence[str],
        profile: str,
        cache: EstimateCache,
        memory_limit: int | None = None,
    ):
        self.schedules = tuple(schedules)
        self.profile = profile
        self.cache = cache
        # The device's memory: a step whose traced memory alone exceeds it is not priced
        # (estimate_mapping). None: every step is.
        self.memory_limit = memory_limit
        self.traced = 0  # traces taken
        self._programs: dict[str, Traced] = {}
        self._ops: dict[str, int] = {}  # by traced configuration: its program's ops
        self._memories: dict[str, StepMemory] = {}
        self._estimates: dict[str, Estimate] = {}
        self._priced: dict[str, set[str]] = {}  # by traced configuration: schedules priced
        # By traced configuration and schedule: whether the live-bytes bound withdrew
        # placements from the order (jaxmoe.plan.layer_extrapolation).
        self._bound_withdrew: dict[str, dict[str, bool]] = {}
        self._bounds: dict[str, float] = {}  # by traced configuration: its screen's step bound
        # A schedule that may overlap communication is bounded by the larger of its
        # computation and its link's work; by its computation alone where a schedule
        # rewrites exchanges into other collectives (comet), which may cost the link less.
        self._compute_only = any(s != "none" for s in schedules)
        self._link_bounds = not any(s in scheduling.names.DECOMPOSING for s in schedules)

    def _trace(self, config: Config) -> Traced:
        key = _key(config)
        found = self._programs.pop(key, None)
        if found is None:
            self.traced += 1
            found = trace(config)
            self._ops[key] = len(found.program.ops)
        self._programs[key] = found  # the latest last
        while len(self._programs) > 1 and (
            len(self._programs) > PROGRAMS_KEPT
            or sum(len(kept.program.ops) for kept in self._programs.values()) > OPS_KEPT
        ):
            self._programs.pop(self._least_needed())
        return found

    def _least_needed(self) -> str:
        """The kept program least likely to be read again: the oldest already estimated,
        else the one whose screen bounds its mapping highest, else the oldest."""
        for key in self._programs:
            if key in self._estimates:
                return key
        bounded = [key for key in self._programs if key in self._bounds]
        return max(bounded, key=self._bounds.__getitem__) if bounded else next(iter(self._programs))

    def ops(self, config: Config) -> int:
        """How many ops the step of ``config`` traced as it is (at its depth) has."""
        key = _key(config)
        if key not in self._ops:
            self._trace(config)
        return self._ops[key]

    def memory(self, config: Config) -> StepMemory:
        """The memory walk of ``config`` traced as it is (at its depth)."""
        key = _key(config)
        if key not in self._memories:
            traced = self._trace(config)
            self._memories[key] = step_memory(traced.program, traced.run.state_shapes)
        return self._memories[key]

    def estimate(self, config: Config, schedules: Sequence[str] | None = None) -> Estimate:
        """Memory and simulated steps of ``config`` traced as it is (at its depth), under
        ``schedules`` (default: the plan's; those that apply), each priced once."""
        key = _key(config)
        wanted = self.schedules if schedules is None else tuple(schedules)
        priced = self._priced.setdefault(key, set())
        missing = [s for s in wanted if s not in priced]
        if missing:
            memory = self.memory(config)
            (_, times), withdrew = _estimate_program(
                self._trace(config), memory, config, missing, self.profile
            )
            priced.update(missing)
            _, known = self._estimates.setdefault(key, (memory, {}))
            known.update(times)
            self._bound_withdrew.setdefault(key, {}).update(withdrew)
        memory, known = self._estimates[key]
        return memory, {s: known[s] for s in wanted if s in known}

    def bound_withdrew(self, config: Config, schedule: str) -> bool:
        """Whether ``schedule``'s live-bytes bound withdrew placements from the order of
        ``config`` traced as it is (estimated first where it is not)."""
        self.estimate(config)
        return self._bound_withdrew[_key(config)][schedule]

    def over_memory(self, memory: StepMemory) -> bool:
        """Whether a step of ``memory`` cannot fit the device under any schedule: a
        schedule's gathers held ahead of use only add to it."""
        return self.memory_limit is not None and memory.total > self.memory_limit

    def _screen_tag(self, extrapolate_layers: bool) -> str:
        return ",".join(self.schedules) + (":extrapolated" if extrapolate_layers else "")

    def cached_screen(self, config: Config, extrapolate_layers: bool) -> Screen | None:
        """The bounds of ``config`` where the plan's cache holds them, else None."""
        return self.cache.load_screen(config, self._screen_tag(extrapolate_layers))

    def screen(self, config: Config, extrapolate_layers: bool) -> Screen:
        """The bounds of ``config`` (:mod:`jaxmoe.plan.bounds`), from a one-block trace
        (or a whole one: ``extrapolate_layers`` off, or a model of fewer than
        :data:`~jaxmoe.plan.layer_extrapolation.MIN_SCREENED_BLOCKS` blocks)."""
        found = self.cached_screen(config, extrapolate_layers)
        if found is not None:
            return found
        tag = self._screen_tag(extrapolate_layers)
        shallow = extrapolate_layers and screens_shallow(config)
        traced = with_blocks(config, 1) if shallow else config
        step = self._trace(traced)
        program = step.program
        policy = schedule_policy(with_schedule(config, "none", self.profile))
        blocks = block_count(config) or 1
        state = state_bytes(config)
        options = options_of(config)
        found = screen(
            program,
            step.run.state_shapes,
            cost_model(policy, program.mesh, program),
            options,
            blocks,
            1 if shallow else blocks,
            state,
            self._compute_only,
            self._link_bounds,
            config.model.first_dense_layers,
        )
        self._bounds[_key(traced)] = found.step_bound(options)
        self.cache.save_screen(config, tag, found)
        return found


def _key(config: Config) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


def state_bytes(config: Config) -> int:
    """The bytes per device of ``config``'s parameters and optimizer state, as the state
    holds them (:func:`~jaxmoe.plan.state_memory.memory_per_device`); from shallow models
    for a deep one (exact: every block holds the same)."""
    values = config.to_dict()
    # Neither the dispatcher, the recomputation nor the microbatches change the state.
    values["moe"]["dispatcher"] = DISPATCHERS[0]
    values["model"]["recompute"] = "none"
    values["train"]["microbatches"] = 1
    return _state_bytes(json.dumps(values, sort_keys=True))


@functools.lru_cache(maxsize=4096)
def _state_bytes(values: str) -> int:
    config = Config.from_dict(json.loads(values))

    def held(config: Config) -> int:
        memory = memory_per_device(config)
        return memory.parameters + memory.optimizer

    if not extrapolates(config):
        return held(config)
    blocks = block_count(config)
    assert blocks is not None
    shallow, deeper = (held(with_blocks(config, b)) for b in TRACED_BLOCKS)
    return shallow + (blocks - TRACED_BLOCKS[0]) * (deeper - shallow)


def cached_estimate(
    config: Config,
    schedules: Sequence[str],
    profile: str,
    cache: EstimateCache,
    extrapolate_layers: bool = True,
) -> Estimate | None:
    """The estimate of ``config`` (:func:`estimate_mapping`) where the cache holds it under
    every schedule that applies, else None."""
    method = "extrapolated" if extrapolate_layers and extrapolates(config) else "traced"
    keyed = applicable_schedules(config, schedules, profile)
    found = {s: cache.load(keyed[s], s, method) for s in keyed}
    if not all(found.values()):
        return None
    memory = next(iter(found.values()))[0]  # type: ignore[index]
    return memory, {s: hit[1] for s, hit in found.items()}  # type: ignore[index]


def estimate_mapping(
    config: Config,
    schedules: Sequence[str],
    profile: str,
    cache: EstimateCache,
    *,
    extrapolate_layers: bool = True,
    tracer: Tracer | None = None,
) -> Estimate:
    """Memory per device and the simulated step of each schedule, for a mapped config.

    Nothing is traced when every schedule is cached. Otherwise the step is traced once
    for all schedules, or, with ``extrapolate_layers`` and a model of at least
    :data:`~jaxmoe.plan.layer_extrapolation.MIN_BLOCKS` repeating blocks, once at each
    depth of :data:`~jaxmoe.plan.layer_extrapolation.TRACED_BLOCKS` (and deeper for a
    schedule whose live-bytes bound withdraws at one of them only), and the figures are
    extrapolated to the model's depth (:mod:`jaxmoe.plan.layer_extrapolation`).
    ``tracer``: the plan's traces, reused. Where the memory alone exceeds the tracer's
    ``memory_limit``, no schedule is priced: the times are empty (and nothing is cached)."""
    found = cached_estimate(config, schedules, profile, cache, extrapolate_layers)
    if found is not None:
        return found
    method = "extrapolated" if extrapolate_layers and extrapolates(config) else "traced"
    keyed = applicable_schedules(config, schedules, profile)
    schedules = tuple(keyed)
    tracer = tracer or Tracer(schedules, profile, cache)
    if method == "traced":
        memory = tracer.memory(config)
        if tracer.over_memory(memory):
            return memory, {}
        memory, times = tracer.estimate(config)
    else:
        blocks = block_count(config)
        assert blocks is not None
        depths = [with_blocks(config, b) for b in TRACED_BLOCKS]
        memory = extrapolate(*(tracer.memory(depth) for depth in depths), blocks)
        if tracer.over_memory(memory):
            return memory, {}
        times = {s: _depth_line_time(tracer, config, s, blocks) for s in schedules}
    for schedule in schedules:
        cache.save(keyed[schedule], schedule, method, memory, times[schedule])
    return memory, times


def _depth_line_time(tracer: Tracer, config: Config, schedule: str, blocks: int) -> StepTime:
    """``schedule``'s step of ``config``'s ``blocks`` blocks, on the line through the two
    depths :func:`~jaxmoe.plan.layer_extrapolation.line_depths` gives."""

    def bound_withdrew(depth: int) -> bool:
        return tracer.bound_withdrew(with_blocks(config, depth), schedule)

    depths = line_depths(
        schedule, bound_withdrew, blocks, lambda depth: tracer.ops(with_blocks(config, depth))
    )
    # A depth only this schedule's line runs through (a paired line's deeper one) is priced
    # under this schedule alone.
    first, second = (
        tracer.estimate(with_blocks(config, depth), (schedule,))[1][schedule] for depth in depths
    )
    return _extrapolated_time(first, second, blocks, *depths)


def _extrapolated_time(
    shallow: StepTime,
    deeper: StepTime,
    blocks: int,
    shallow_blocks: int = TRACED_BLOCKS[0],
    deeper_blocks: int | None = None,
) -> StepTime:
    """A ``blocks``-block step from the steps of the traced depths: the times grow by a
    block's each block, but the step runs all its computation on one stream and all its
    collectives on one link, so it is no shorter than either (where a further block's
    communication hides better than the first's, the exposed communication's growth would
    say otherwise); the gathers held ahead of use are a maximum over the step (a schedule
    prefetches a few blocks ahead however deep the model), the deeper step's."""
    grown = extrapolate(shallow, deeper, blocks, shallow_blocks, deeper_blocks)
    return dataclasses.replace(
        grown,
        step=max(grown.step, grown.compute, grown.communication),
        exposed_communication=max(grown.exposed_communication, 0.0),
        prefetched=max(shallow.prefetched, deeper.prefetched),
    )
