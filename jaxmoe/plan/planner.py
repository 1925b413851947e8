"""The mapping planner (``jaxmoe plan``): the parallel mappings of a model on N devices,
estimated and ranked.

A mapping is a layout and the options it runs with (ZeRO stage, recomputation,
microbatches: :mod:`jaxmoe.plan.mappings`, :mod:`jaxmoe.plan.options`). To estimate one,
the per-device train step is traced on an abstract mesh of N devices (no devices are
needed, so N may exceed this host's) and priced as ``jaxmoe schedule`` prices it: the
scheduler's cost model and two-stream simulator on a device profile, for each schedule
asked for; the fastest counts. Its memory per device is the step's peak as XLA:GPU holds
it (:func:`jaxmoe.plan.memory.step_memory`). The MFU is the model FLOPs of a step
(:mod:`jaxmoe.plan.model_flops`, nothing dropped) over step time x devices x the
profile's peak. Mappings over the profile's device memory are dropped; the rest are
ranked, best MFU first.

The space is large (a 56-layer model on 256 devices: over a hundred layouts, each with
nine option sets or more) and an estimate of a deep model traces the step twice (two
blocks and three, :mod:`jaxmoe.plan.layer_extrapolation`), so mappings are estimated in
order of a lower bound of their step time, and only until the ``top`` best are known
(:mod:`jaxmoe.plan.search`):

1. A mapping whose state alone (its parameters and optimizer state, analytic:
   :func:`~jaxmoe.plan.state_memory.memory_per_device`) exceeds the device's memory is
   dropped untraced.
2. Each layout is traced once with one block under its options of least memory
   (:func:`~jaxmoe.plan.options.least_memory`): lower bounds of the step time and the
   memory of each of its option sets (:mod:`jaxmoe.plan.bounds`). A pipeline is bounded
   from its stage layout's trace without a pipeline; where that is no layout of these
   devices (their rows do not split so far) or its first stage holds leading dense
   layers, from traces of its own, one for each number of microbatches. Those whose
   memory bound exceeds the device's are dropped.
3. Least first bound first (:mod:`jaxmoe.plan.search`), a mapping gets a trace of its
   own (a tighter bound), then, unless that rules it out, its estimate (the traces of
   the least bounds are kept: a model of few blocks, screened from its whole trace, is
   estimated from it). A recomputation is searched only where the same layout and
   options recomputing less do not fit: it adds work and frees memory, so it is no
   faster (:mod:`jaxmoe.plan.options`), and its bound is at least theirs. A mapping
   whose traced step alone needs more memory than the device has is left out there,
   before any schedule prices it (a schedule's gathers held ahead of use only add).
   Once the ``top`` best estimates that fit are no slower than every bound left, the
   search stops: those are the ``top`` best of all mappings. The rest are listed with
   their bounds. With a time limit (``jaxmoe plan --time-limit``) the search may stop
   earlier: the best estimated so far, not proven the best.

The bounds hold for the ``none`` schedule; other schedules may hide communication, and
are bounded by the larger of their computation and their link's work (by their
computation alone for a pipeline, and where ``comet`` rewrites the exchanges).

Estimates and bounds are kept on disk (``$XDG_CACHE_HOME/jaxmoe/plan``), keyed by the
mapped configuration, the profile, the schedule and a digest of this package's and the
scheduler's sources and the JAX versions, so any change to the program or the cost
model estimates afresh.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import scheduling
from jaxmoe.config import Config, ConfigError
from jaxmoe.config.choices import PLANNED_SCHEDULES
from jaxmoe.plan.bounds import Screen
from jaxmoe.plan.collector import collecting_less
from jaxmoe.plan.estimates import EstimateCache, StepTime
from jaxmoe.plan.layer_extrapolation import DEPTH_METHOD, extrapolates
from jaxmoe.plan.mappings import (
    Candidate,
    Mapping,
    MappingSpace,
    context_degrees,
    enumerate_mappings,
    pipelines_of,
    with_options,
)
from jaxmoe.plan.memory import StepMemory
from jaxmoe.plan.mfu import mfu
from jaxmoe.plan.model_flops import model_flops
from jaxmoe.plan.options import Options, bounding, option_sets, options_of, recompute_chains
from jaxmoe.plan.search import Advance, best_first
from jaxmoe.plan.tracer import (
    Tracer,
    applicable_schedules,
    cached_estimate,
    estimate_mapping,
    state_bytes,
)
from jaxmoe.plan.workers import TracePool, Work

MEMORY_METHOD = (
    "per device, the peak of the step as XLA:GPU holds it (jaxmoe/plan/memory.py): the "
    "captured per-device step walked with each op as soon as its operands are ready "
    "(forward ops first: nothing orders one microbatch's backward pass before the next "
    "one's forward pass; a pipeline's ticks in their order, each tick's forward slot "
    "before its backward slot), every value a buffer unless XLA fuses it into all its "
    "readers, "
    "the buffers alive after each op summed. At the peak: the state (master: the "
    "parameters as the state holds them; optim: AdamW moments and counts, gradient-sync "
    "state, placement, step) and the batch throughout; params: the parameters as the step "
    "computes with them (casts to the compute dtype, ZeRO's gathers, and the gathers a "
    "schedule starts ahead of their use); activ: forward "
    "values, a recomputation's included; backward: gradients, their accumulators and the "
    "backward pass's working buffers. Within 10% of XLA:CPU's compiled memory analysis on "
    "small models (tests/plan/test_memory.py), a few percent under it (XLA's heap leaves "
    "gaps); for pipelines XLA:CPU holds more than the tick order (up to 8% more on 2 "
    "stages: it runs forward slots before the previous tick's backward slot), and less "
    "than every forward slot a stage's chunks of ticks early."
)


@dataclass(frozen=True)
class MappingEstimate:
    mapping: Mapping
    memory: StepMemory
    times: dict[str, StepTime]  # schedule -> its simulated step
    mfu: float  # of the fastest schedule
    fits: bool  # peak_bytes within the profile's device memory (or it is not known)

    @staticmethod
    def priced(
        mapping: Mapping,
        memory: StepMemory,
        times: dict[str, StepTime],
        flops: float,
        peak: float,
        capacity: float,
    ) -> MappingEstimate:
        """The estimate of ``mapping`` from its memory and each schedule's simulated step
        (at least one): the fastest's MFU at ``flops`` a step and ``peak`` FLOP/s a
        device, and whether its peak fits ``capacity`` bytes (0: nothing is over)."""
        fastest = min(times.values(), key=lambda t: t.step)
        peak_bytes = memory.total + fastest.prefetched
        return MappingEstimate(
            mapping=mapping,
            memory=memory,
            times=times,
            mfu=mfu(flops, fastest.step, mapping.devices, peak),
            fits=not (capacity and peak_bytes > capacity),
        )

    @property
    def schedule(self) -> str:
        return min(self.times, key=lambda name: self.times[name].step)

    @property
    def best(self) -> StepTime:
        return self.times[self.schedule]

    @property
    def peak_bytes(self) -> int:
        """Memory per device at the step's peak under the fastest schedule: the walk's,
        and the gathers it starts early."""
        return self.memory.total + self.best.prefetched

    def to_json(self) -> dict[str, Any]:
        return {
            "mapping": self.mapping.to_json(),
            "schedule": self.schedule,
            "step_seconds": self.best.step,
            "mfu": self.mfu,
            "memory_bytes": self.memory.to_json(),
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "by_schedule": {name: dataclasses.asdict(t) for name, t in self.times.items()},
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> MappingEstimate:
        """The estimate whose :meth:`to_json` is ``data`` (its derived figures aside)."""
        mapping = {f.name for f in dataclasses.fields(Mapping)}
        memory = {f.name for f in dataclasses.fields(StepMemory)}
        return MappingEstimate(
            Mapping(**{k: v for k, v in data["mapping"].items() if k in mapping}),
            StepMemory(**{k: v for k, v in data["memory_bytes"].items() if k in memory}),
            {name: StepTime(**time) for name, time in data["by_schedule"].items()},
            data["mfu"],
            data["fits"],
        )


@dataclass(frozen=True)
class NotEstimated:
    """A valid mapping the planner did not estimate, why, and its bounds where known."""

    mapping: Mapping
    # "refused" (by Config), "state", "memory" or "step" (its bound), "recompute" (the same
    # options recomputing less fit), or "time" (its bound was under the best estimated when
    # the search reached its time limit)
    kind: str
    reason: str
    step_bound: float | None = None  # seconds
    memory_bound: int | None = None  # bytes per device

    def to_json(self) -> dict[str, Any]:
        return {
            "mapping": self.mapping.to_json(),
            "kind": self.kind,
            "reason": self.reason,
            "step_seconds_at_least": self.step_bound,
            "memory_bytes_at_least": self.memory_bound,
        }


@dataclass(frozen=True)
class PlanResult:
    preset: str
    devices: int
    profile: scheduling.DeviceProfile
    schedules: tuple[str, ...]
    model_flops_per_step: float
    space: MappingSpace  # the layouts
    estimates: list[MappingEstimate]  # ranked: those that fit, best MFU first, then the rest
    extrapolated: bool = False  # deep models estimated from shallow traces
    peak_flops_per_s: float = 0.0  # the profile's for the model's dtype (the MFU's peak)
    not_estimated: tuple[NotEstimated, ...] = ()
    top: int = 0  # the best mappings the search made sure of (0: all were estimated)
    # Whether the top mappings are proven the best (False: the time limit cut the search).
    complete: bool = True
    # How far under the slowest of the top mappings one left unestimated may be (a fraction;
    # 0: the top are the best exactly).
    gap: float = 0.0

    @property
    def ranked(self) -> list[MappingEstimate]:
        return [e for e in self.estimates if e.fits]

    @property
    def over_memory(self) -> list[MappingEstimate]:
        return [e for e in self.estimates if not e.fits]

    @property
    def least_bound_left(self) -> float | None:
        """Where the time limit cut the search: the least step-time bound (seconds) of the
        mappings it left unestimated under the best, so none of them is faster (every
        layout is screened before the limit applies); None where none was left."""
        bounds = [n.step_bound for n in self.not_estimated if n.kind == "time" and n.step_bound]
        return min(bounds, default=None)

    def to_json(self, command: str = "") -> dict[str, Any]:
        return {
            "command": command,
            "preset": self.preset,
            "devices": self.devices,
            "profile": self.profile.name,
            "peak_flops_per_s": self.peak_flops_per_s,
            "memory_capacity_bytes": self.profile.memory_capacity_bytes or None,
            "schedules": list(self.schedules),
            "model_flops_per_step": self.model_flops_per_step,
            "memory_method": MEMORY_METHOD,
            "depth": DEPTH_METHOD if self.extrapolated else "traced whole",
            "top": self.top,
            "complete": self.complete,
            "gap": self.gap,
            "least_step_seconds_left": self.least_bound_left,
            "ranked": [{"rank": i + 1, **e.to_json()} for i, e in enumerate(self.ranked)],
            "over_memory": [e.to_json() for e in self.over_memory],
            "not_estimated": [n.to_json() for n in self.not_estimated],
            "skipped": [
                {"mapping": c.mapping.to_json(), "reason": c.reason} for c in self.space.skipped
            ],
        }


def check_plan_inputs(config: Config, devices: int, profile: str, schedules: Sequence[str]):
    """Every input of a plan, refused with one ConfigError line before anything is traced."""
    if not schedules:
        raise ConfigError("--schedule: name at least one schedule")
    if profile not in scheduling.PROFILES:
        raise ConfigError(
            f"--profile {profile!r}: choose one of {', '.join(sorted(scheduling.PROFILES))}"
        )
    for schedule in schedules:
        if schedule not in scheduling.names.POLICIES:
            raise ConfigError(
                f"--schedule {schedule!r}: choose from {', '.join(scheduling.names.POLICIES)}"
            )
    # Each mapping is estimated under the schedules that apply to it (pair: two
    # microbatches or a pipeline); the configuration validates them against the rest.
    applicable_schedules(config, schedules, profile)


@dataclass(frozen=True)
class _Pending:
    """A mapping in the search: its layout, its options, and the screen its bound comes
    from (its own trace's, or that of the layout's options it was bounded from); and the
    same layout and options recomputing more, each with its bound, tried only where this
    one does not fit (:func:`~jaxmoe.plan.options.recompute_chains`)."""

    layout: Candidate
    options: Options
    screen: Screen | None
    own: bool
    more_recomputed: tuple[tuple[float, _Pending], ...] = ()

    def mapping(self) -> Mapping:
        return self.layout.mapping.with_options(self.options)

    def next_recomputed(self, at_least: float) -> tuple[tuple[float, _Pending], ...]:
        """The next set to try, where this one does not fit: its bound, at least
        ``at_least`` (this one's step or bound: recomputing more is no faster)."""
        if not self.more_recomputed:
            return ()
        (bound, following), *rest = self.more_recomputed
        released = dataclasses.replace(following, more_recomputed=tuple(rest))
        return ((max(bound, at_least), released),)


@collecting_less
def plan_mappings(
    config: Config,
    preset: str,
    devices: int,
    profile: str,
    schedules: Sequence[str] = PLANNED_SCHEDULES,
    *,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
    memory_capacity_bytes: float | None = None,
    extrapolate_layers: bool = True,
    top: int = 10,
    options: bool = True,
    pipeline: bool = True,
    max_virtual_stages: int = 2,
    cross_node_tensor: bool = False,
    time_limit: float | None = None,
    layouts: Callable[[Mapping], bool] | None = None,
    jobs: int = 1,
    gap: float = 0.0,
) -> PlanResult:
    """Estimate and rank the mappings of ``config``'s model on ``devices`` devices (module
    docstring): the ``top`` best that fit, and every mapping estimated on the way.

    Raises ConfigError (before tracing anything) for a bad input, or when no mapping is
    valid. ``cache_dir``: where estimates are kept (None: nowhere).
    ``memory_capacity_bytes``: the memory a device offers (default: the profile's).
    ``extrapolate_layers``: estimate deep models from shallow traces (see
    :func:`estimate_mapping`). ``options``: try every ZeRO stage, recomputation and number
    of microbatches (else ``config``'s alone). ``pipeline``: also pipelines of stages
    dividing the devices, with up to ``max_virtual_stages`` chunks per stage of at least
    one block each (uneven where the blocks do not divide:
    :func:`~jaxmoe.plan.mappings.pipelines_of`). ``cross_node_tensor``: also tensor
    groups wider than a node (:mod:`jaxmoe.plan.mappings`; a flat profile has no nodes).
    ``preset``: what the table calls the configuration (a preset's name, a file's path).
    ``time_limit``: seconds from the start after which the search estimates no more
    mappings (the layouts' screens are all taken first): the ranking is then of the
    mappings estimated (``PlanResult.complete`` False), those left listed with their
    bounds. ``layouts``: which layouts to search (None: all); the others are skipped,
    saying so. ``jobs``: how many worker processes trace side by side
    (:mod:`jaxmoe.plan.workers`; 1: this process alone); the ranking is the same. ``gap``:
    stop once no mapping left can be faster than ``1 - gap`` times the ``top``-th best
    estimated (:func:`~jaxmoe.plan.search.best_first`; 0: the ``top`` best exactly)."""
    started = time.monotonic()
    check_plan_inputs(config, devices, profile, schedules)
    if time_limit is not None and not time_limit > 0:
        raise ConfigError(f"--time-limit {time_limit}: give a number of seconds > 0")
    if top < 1:
        raise ConfigError(f"--top {top}: rank at least one mapping")
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: give a number of worker processes >= 1")
    if not 0.0 <= gap < 1.0:
        raise ConfigError(f"--gap {gap}: give a fraction of the step in [0, 1), e.g. 0.02")
    device = scheduling.PROFILES[profile]
    per_node = device.devices_per_node
    pipelines = pipelines_of(config, devices, max_virtual_stages) if pipeline else [(1, 1)]
    space = enumerate_mappings(
        config,
        devices,
        per_node,
        max_tensor=None if cross_node_tensor or not per_node else per_node,
        pipelines=pipelines,
        contexts=context_degrees(config, devices),
    )
    if layouts is not None:
        space = MappingSpace(
            [c for c in space.valid if layouts(c.mapping)],
            space.skipped
            + [
                dataclasses.replace(c, config=None, reason="outside the layouts asked for")
                for c in space.valid
                if not layouts(c.mapping)
            ],
        )
    if not space.valid:
        reasons = space.skipped_summary()
        raise ConfigError(
            f"no valid mapping of {preset!r} on {devices} devices; "
            f"{len(space.skipped)} refused, most often: {reasons[0] if reasons else 'none'}"
        )
    if memory_capacity_bytes is not None:
        device = dataclasses.replace(device, memory_capacity_bytes=memory_capacity_bytes)
    capacity = device.memory_capacity_bytes
    cache = EstimateCache(cache_dir)
    memory_limit = capacity or None  # the device's memory, where the profile gives it
    tracer = Tracer(schedules, profile, cache, memory_limit)
    flops = model_flops(config).train_step()
    peak = device.peak_flops_per_s(config.model.dtype)
    estimates: list[MappingEstimate] = []
    left_out: list[NotEstimated] = []
    say = progress or (lambda line: None)

    def over(memory: int) -> bool:
        return bool(capacity) and memory > capacity

    def leave(mapping: Mapping, kind: str, reason: str, memory: int | None = None) -> None:
        left_out.append(NotEstimated(mapping, kind, reason, memory_bound=memory))

    pool = (
        TracePool(jobs, schedules, profile, cache_dir, extrapolate_layers, memory_limit)
        if jobs > 1
        else None
    )

    def screens_of(configs: list[tuple[Config, Mapping]]) -> list[Screen]:
        """The bounds of each configuration (on the workers, those not cached)."""
        found: list[Screen | None] = [
            tracer.cached_screen(c, extrapolate_layers) if pool is not None else None
            for c, _ in configs
        ]
        traced = [i for i, screen in enumerate(found) if screen is None]
        if pool is not None and traced:
            work = [Work("screen", configs[i][0], configs[i][1]) for i in traced]
            for i, screen in zip(traced, pool.run(work), strict=True):
                found[i] = screen
        return [
            screen if screen is not None else tracer.screen(c, extrapolate_layers)
            for screen, (c, _) in zip(found, configs, strict=True)
        ]

    # Each layout's option sets that Config accepts, and the state of each ZeRO stage;
    # then the screens of the layouts (and of the pipelines bounded on their own), all at
    # once.
    laid_out = []
    for layout in space.valid:
        assert layout.config is not None
        mapping = layout.mapping
        sets = option_sets(layout.config, options) if options else [options_of(config)]
        states = {}  # ZeRO stage -> the state's bytes (the options change nothing else)
        for zero in sorted({o.zero for o in sets}):
            staged = with_options(layout, Options(zero=zero), per_node)
            if staged.config is None:
                for o in sets:
                    if o.zero == zero:
                        leave(mapping.with_options(o), "refused", staged.reason)
            else:
                states[zero] = state_bytes(staged.config)
        sets = [o for o in sets if o.zero in states]
        if not sets:
            continue
        if over(min(states.values())):
            least = min(states.values())
            reason = (
                f"its state alone needs {least / 1e9:.1f} GB or more (that of the options of "
                "least memory)"
            )
            for o in sets:
                leave(mapping.with_options(o), "state", reason, least)
            continue
        traced = None
        if mapping.pipeline == 1:
            traced = with_options(layout, bounding(sets), per_node)
            if traced.config is None:
                for o in sets:
                    leave(mapping.with_options(o), "refused", traced.reason)
                continue
        laid_out.append((layout, sets, states, traced))
    # A pipeline is bounded from its stage layout's screen without a pipeline; where that
    # layout is not valid on these devices (their rows do not split), or its first stage
    # holds the leading dense layers, from screens of its own: one for each number of
    # microbatches (idle ticks run on zeros, so more microbatches do less work a tick).
    staged = {traced.mapping.stage_layout for _, _, _, traced in laid_out if traced is not None}
    to_pipe: list[Candidate] = []  # the pipelines screened on their own
    for layout, sets, _, traced in laid_out:
        if traced is None and (
            config.model.first_dense_layers or layout.mapping.stage_layout not in staged
        ):
            for count in sorted({o.microbatches for o in sets}):
                own = with_options(
                    layout, bounding([o for o in sets if o.microbatches == count]), per_node
                )
                if own.config is not None:
                    to_pipe.append(own)
    to_screen = [traced for _, _, _, traced in laid_out if traced is not None] + to_pipe
    screens: dict[tuple, Screen] = {}  # stage layout (or a pipeline's, microbatches) -> screen
    for index, (traced, found) in enumerate(
        zip(to_screen, screens_of([(t.config, t.mapping) for t in to_screen]), strict=True)
    ):
        screens[_screened(traced.mapping)] = found
        say(f"[{index + 1}/{len(to_screen)}] bounds from {traced.mapping.label()}")

    def pending_of(layout: Candidate, o: Options, states: dict) -> tuple[float, _Pending] | None:
        """``layout`` with ``o`` in the search with its bound, or None (left out: its
        memory bound is over the device's)."""
        mapping = layout.mapping
        bounds = screens.get(_screened(mapping.with_options(o)))  # its layout's own
        # Else from a pipeline's stage layout without a pipeline (not where its first stage
        # holds the dense layers).
        staged_screen = (
            None if config.model.first_dense_layers else screens.get(mapping.stage_layout)
        )
        from_stages = bounds is None and mapping.pipeline > 1 and staged_screen is not None
        if bounds is not None:
            memory = bounds.memory_bound(o, states[o.zero])
        elif from_stages:
            bounds = staged_screen
            memory = bounds.pipeline_memory_bound(
                o, states[o.zero], mapping.pipeline, mapping.virtual_stages
            )
        else:
            return 0.0, _Pending(layout, o, None, False)
        if over(memory):
            leave(mapping.with_options(o), "memory", _over_reason(memory), memory)
            return None
        if from_stages:
            step = bounds.pipeline_step_bound(o, mapping.pipeline, mapping.virtual_stages)
            return step, _Pending(layout, o, bounds, False)
        return bounds.step_bound(o), _Pending(layout, o, bounds, o == bounds.options)

    # Each stage and microbatch count's option sets least recomputation first: the first
    # that is not over memory is searched, the rest wait until it does not fit.
    start = []
    for layout, sets, states, _ in laid_out:
        for chain in recompute_chains(sets):
            found = [p for p in (pending_of(layout, o, states) for o in chain) if p is not None]
            if found:
                bound, first = found[0]
                start.append((bound, dataclasses.replace(first, more_recomputed=tuple(found[1:]))))

    # What the workers found for the candidates taken together, by candidate.
    prepared: dict[int, Any] = {}

    def prepare(pendings: list[_Pending]) -> None:
        if pool is None:
            return
        work, ids = [], []
        for pending in pendings:
            candidate = with_options(pending.layout, pending.options, per_node)
            if candidate.config is None:
                continue
            if not pending.own:
                if tracer.cached_screen(candidate.config, extrapolate_layers) is None:
                    work.append(Work("screen", candidate.config, candidate.mapping))
                    ids.append(id(pending))
            elif (
                cached_estimate(candidate.config, schedules, profile, cache, extrapolate_layers)
                is None
            ):
                work.append(Work("estimate", candidate.config, candidate.mapping))
                ids.append(id(pending))
        prepared.update(zip(ids, pool.run(work), strict=True))

    def advance(pending: _Pending) -> Advance:
        candidate = with_options(pending.layout, pending.options, per_node)
        if candidate.config is None:
            leave(candidate.mapping, "refused", candidate.reason)
            return Advance(releases=pending.next_recomputed(0.0))
        options_now = pending.options
        found = prepared.pop(id(pending), None)
        if not pending.own:
            own = found or tracer.screen(candidate.config, extrapolate_layers)
            memory = own.memory_bound(options_now, state_bytes(candidate.config))
            bound = own.step_bound(options_now)
            say(
                f"bounds of {candidate.mapping.label()}: "
                f"{bound * 1e3:.1f} ms, {memory / 1e9:.1f} GB"
            )
            if over(memory):
                leave(candidate.mapping, "memory", _over_reason(memory), memory)
                return Advance(releases=pending.next_recomputed(bound))
            return Advance(bound, dataclasses.replace(pending, screen=own, own=True))
        memory, times = found or estimate_mapping(
            candidate.config,
            schedules,
            profile,
            cache,
            extrapolate_layers=extrapolate_layers,
            tracer=tracer,
        )
        if not times:  # its memory alone is over the device's: not priced
            reason = (
                f"its traced step needs {memory.total / 1e9:.1f} GB per device, over the device's"
            )
            leave(candidate.mapping, "memory", reason, memory.total)
            # Those recomputing more are no faster than it: bounded by its own screen.
            assert pending.screen is not None
            return Advance(releases=pending.next_recomputed(pending.screen.step_bound(options_now)))
        estimate = MappingEstimate.priced(candidate.mapping, memory, times, flops, peak, capacity)
        step = estimate.best.step
        estimates.append(estimate)
        say(
            f"estimated {candidate.mapping.label()}: {step * 1e3:.3f} ms, "
            f"{estimate.peak_bytes / 1e9:.3f} GB"
        )
        if not estimate.fits:
            return Advance(estimated=True, releases=pending.next_recomputed(step))
        reason = f"it recomputes more than {pending.options.recompute}, which fits: no faster"
        left_out.extend(
            NotEstimated(more.mapping(), "recompute", reason, step_bound=max(bound, step))
            for bound, more in pending.more_recomputed
        )
        return Advance(estimated=True, figure=step)

    deadline = None if time_limit is None else started + time_limit
    end = best_first(start, advance, top, deadline, width=jobs, prepare=prepare, gap=gap)
    if pool is not None:
        pool.close()
    best = sorted(e.best.step for e in estimates if e.fits)[top - 1 : top]

    def why_left(bound: float) -> tuple[str, str]:
        if best and bound >= best[0]:
            return "step", (
                f"its step takes at least {bound * 1e3:.1f} ms, no less than the {top} best "
                "estimated that fit"
            )
        if end.complete:  # within the gap of the top-th best
            return "step", (
                f"its step takes at least {bound * 1e3:.1f} ms, at most {gap:.0%} under the "
                f"{top} best estimated that fit"
            )
        return "time", (
            f"its step takes at least {bound * 1e3:.1f} ms; not estimated within the "
            f"time limit of {time_limit:g} s"
        )

    # What the search left, and the sets each of them held back (recomputing more: no
    # faster than it, so bounded by its bound too).
    left = [
        (max(bound, more_bound), more)
        for bound, pending in end.left
        for more_bound, more in ((bound, pending), *pending.more_recomputed)
    ]
    left_out += [
        NotEstimated(pending.mapping(), *why_left(bound), step_bound=bound)
        for bound, pending in left
    ]
    estimates.sort(key=lambda e: (not e.fits, -e.mfu, e.peak_bytes))
    extrapolated = extrapolate_layers and extrapolates(config)
    return PlanResult(
        preset,
        devices,
        device,
        tuple(schedules),
        flops,
        space,
        estimates,
        extrapolated,
        peak,
        tuple(left_out),
        top,
        end.complete,
        gap,
    )


def _screened(mapping: Mapping) -> tuple:
    """What a screen bounds: a stage layout without a pipeline, or a pipeline's layout in
    a number of microbatches."""
    if mapping.pipeline == 1:
        return mapping.stage_layout
    return mapping.with_options(Options()), mapping.microbatches


def _over_reason(memory: int) -> str:
    return f"needs {memory / 1e9:.1f} GB per device or more (a lower bound), over the device's"
