"""``train.grad_sync auto``: the gradient-sync algorithm estimated to reach a loss soonest.

An algorithm's time to a loss is its step time times the steps it needs per step of an
exact algorithm; ``auto`` picks the smallest:

- **step time**: the algorithm's train step is captured (``scheduling.capture``) and
  every op of it costed by the scheduling layer's cost model on the link the run is
  told (:func:`choice_cost_model`). With measured link curves
  (``schedule.link_curves``, ``jaxmoe link-curves``), a collective whose kind and
  group size they cover costs what its curve says, and every other collective pays the
  curves' fixed cost (the median of their times at their smallest size, the transport's
  cost of one collective: :func:`fixed_cost`) plus its bytes over the told link. The
  step is the sum of its ops (XLA:CPU runs collectives synchronously); on other
  backends ``delayed`` is credited with hiding its average over workers (which only the
  next step reads) behind the step's computation.
- **convergence cost**: how many steps the algorithm takes to reach the loss an exact
  algorithm reaches, per exact step (:class:`ConvergenceCosts`): 1 for the exact
  algorithms (``allreduce``, ``bucketed``, ``hierarchical``: the same updates up to
  float rounding), measured for the relaxed ones by ``experiments/grad_sync_convergence``
  (the file :data:`CONVERGENCE_FILE` names its run). A relaxed algorithm without a
  measurement, or one that did not reach the loss there, is not chosen.

Where the curves and the costs are measured (the emulated cluster and the ``tiny``
preset for the files in this repository) is where the estimate is calibrated; both
files say so, and ``auto`` records them in its choice.

With ``train.grad_sync_trial_steps`` > 0 the algorithms whose estimates lie within
``train.grad_sync_trial_margin`` of the best are timed on the run's mesh
(:mod:`jaxmoe.plan.grad_sync_trial`), and the least measured step times convergence
cost decides among them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

import scheduling
from jaxmoe.config import Config
from jaxmoe.parallel.grad_sync import ALGORITHMS, EXACT
from jaxmoe.parallel.grad_sync.decentralized import MIX_SCOPE
from jaxmoe.parallel.grad_sync.delayed import DEFERRED_SCOPE
from jaxmoe.parallel.grad_sync.hierarchical import devices_per_host
from jaxmoe.plan.grad_sync_trial import measured_step_seconds, trial_batches
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step

# The name scopes of the synchronisation's ops: gradient reductions, parameter mixing.
SYNC_SCOPES = ("grad_reduce", MIX_SCOPE)
CHOICE_FILE = "grad_sync_choice.json"
# The measured convergence costs (experiments/grad_sync_convergence.py writes it).
CONVERGENCE_FILE = Path(__file__).with_name("grad_sync_convergence.json")
# The loss a convergence cost is measured to: the one the exact run reaches after this
# fraction of its steps (the emulated cluster's time-to-target uses the same).
TARGET_FRACTION = 0.7


@dataclass(frozen=True)
class ConvergenceCosts:
    """Steps each relaxed algorithm takes per exact step to reach the same loss."""

    source: str  # where and how they were measured
    target_fraction: float
    # Relaxed algorithm -> steps per exact step; None: did not reach the loss in the run.
    steps_per_allreduce_step: Mapping[str, float | None]

    def of(self, name: str) -> float | None:
        """``name``'s cost: 1 for an exact algorithm, None where not measured or not
        reached."""
        return 1.0 if name in EXACT else self.steps_per_allreduce_step.get(name)

    @classmethod
    def load(cls, path: str | Path = CONVERGENCE_FILE) -> ConvergenceCosts:
        data = json.loads(Path(path).read_text())
        return cls(data["source"], data["target_fraction"], data["steps_per_allreduce_step"])


@dataclass(frozen=True)
class AlgorithmEstimate:
    name: str
    exact: bool
    sync_seconds: float  # the gradient-sync ops (collectives and their compute) of one step
    step_seconds: float  # the whole step, the sync's exposed part included
    convergence: float | None  # steps per exact step to the same loss (None: unknown)
    measured_step_seconds: float | None = None  # timed in the trial (None: not tried)

    @property
    def time_to_loss(self) -> float:
        """Seconds per exact step's worth of progress: step time (measured where it was
        tried) x convergence cost."""
        if self.convergence is None:
            return math.inf
        measured = self.measured_step_seconds
        return (self.step_seconds if measured is None else measured) * self.convergence


@dataclass(frozen=True)
class GradSyncChoice:
    chosen: str
    reason: str
    link: str  # the link the estimates are for, in words
    convergence_source: str
    estimates: tuple[AlgorithmEstimate, ...]

    def table(self) -> str:
        lines = [
            f"grad_sync auto -> {self.chosen}: {self.reason}",
            f"  link: {self.link}",
            f"  convergence: {self.convergence_source}",
            "  algorithm            exact  sync (ms)  step (ms)  tried (ms)  steps/exact  "
            "time (ms)",
        ]
        for e in self.estimates:
            mark = " <-" if e.name == self.chosen else ""
            cost = "-" if e.convergence is None else f"{e.convergence:.3f}"
            time = "-" if e.convergence is None else f"{e.time_to_loss * 1e3:.1f}"
            measured = e.measured_step_seconds
            tried = "-" if measured is None else f"{measured * 1e3:.1f}"
            lines.append(
                f"  {e.name:<20} {'yes' if e.exact else 'no':<5} {e.sync_seconds * 1e3:>9.1f} "
                f"{e.step_seconds * 1e3:>10.1f} {tried:>11} {cost:>12} {time:>10}{mark}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def fixed_cost(curves: scheduling.CollectiveCurves) -> float:
    """What the transport charges a collective of a few bytes: the median over the curves
    of each one's time at its smallest size. Each of those is a difference of two noisy
    timings (a chain of collectives less a single one), so one of them can come out near
    zero; the least of them would price every collective the curves do not cover at
    nothing."""
    return statistics.median(curve.seconds[0] for curve in curves.curves.values())


def choice_cost_model(config: Config, mesh: Mesh) -> tuple[scheduling.CostModel, str]:
    """The cost model of the link ``config`` describes, and that link in words.

    Hosts: :func:`~jaxmoe.parallel.grad_sync.hierarchical.devices_per_host`. The link
    between hosts (shared by a host's devices): ``schedule.profile``'s node link (a
    multi-node profile) or its link; inside a host, a multi-node
    profile's device link, or for a flat profile the device's memory bandwidth (devices
    of one host exchange through memory). With ``schedule.link_curves``, the collectives
    they cover cost what they say, and the others pay the curves' fixed cost
    (:func:`fixed_cost`) once, in place of the profile's latencies.
    """
    train, schedule = config.train, config.schedule
    base = schedule.device_profile
    per_host = devices_per_host(train.grad_sync_devices_per_host, mesh)
    hosts = mesh.devices.size // per_host
    if hosts == 1:
        profile = base
    elif base.devices_per_node:
        profile = dataclasses.replace(base, devices_per_node=per_host)
    else:
        profile = dataclasses.replace(
            base,
            devices_per_node=per_host,
            link_bytes_per_s=base.memory_bytes_per_s,
            node_link_bytes_per_s=base.link_bytes_per_s,
            node_link_latency_s=base.link_latency_s,
        )
    words = f"{hosts} host(s) x {per_host} devices, profile {base.name}"
    if hosts > 1:
        words += f", {profile.node_link_bytes_per_s * 8 / 1e6:g} Mbit/s between hosts"
    curves = None
    if schedule.link_curves:
        curves = scheduling.CollectiveCurves.load(schedule.link_curves)
        fixed = fixed_cost(curves)
        profile = dataclasses.replace(profile, link_latency_s=fixed, node_link_latency_s=0.0)
        words += (
            f", measured curves {Path(schedule.link_curves).name} "
            f"(fixed cost {fixed * 1e3:.1f} ms a collective)"
        )
    return scheduling.CostModel(profile, dict(mesh.shape), curves), words


def estimate(
    config: Config, mesh: Mesh, name: str, cost: scheduling.CostModel, costs: ConvergenceCosts
) -> AlgorithmEstimate:
    with_algorithm = dataclasses.replace(
        config, train=dataclasses.replace(config.train, grad_sync=name)
    )
    program, _ = capture_train_step(resolve(with_algorithm, mesh))
    sync = deferred = compute = communication = 0.0
    for op in program.ops:
        seconds = cost.seconds(op)
        if any(scope in op.name_stack for scope in SYNC_SCOPES):
            sync += seconds
            deferred += seconds if DEFERRED_SCOPE in op.name_stack else 0.0
        elif op.is_collective:
            communication += seconds
        else:
            compute += seconds
    exposed = sync
    if jax.default_backend() != "cpu":
        # delayed's average has the next step's forward and backward to finish behind.
        exposed = sync - deferred + max(0.0, deferred - compute)
    step = compute + communication + exposed
    return AlgorithmEstimate(name, name in EXACT, sync, step, costs.of(name))


def tried(
    estimates: tuple[AlgorithmEstimate, ...], margin: float, measure: Callable[[str], float]
) -> tuple[AlgorithmEstimate, ...]:
    """``estimates`` with the measured step (``measure(name)``, seconds) of each algorithm
    whose estimated time to a loss is within ``margin`` of the best; unchanged when only
    one is."""
    best = min(e.time_to_loss for e in estimates)
    close = [e.name for e in estimates if e.time_to_loss <= best * (1 + margin)]
    if len(close) < 2:
        return estimates
    measured = {name: measure(name) for name in close}
    return tuple(
        dataclasses.replace(e, measured_step_seconds=measured.get(e.name)) for e in estimates
    )


def choose_grad_sync(
    config: Config,
    mesh: Mesh,
    costs: ConvergenceCosts | None = None,
    measure: Callable[[str], float] | None = None,
) -> GradSyncChoice:
    """The algorithm with the least estimated time to a loss (``costs``: the measured
    convergence costs, by default :data:`CONVERGENCE_FILE`'s), or with
    ``train.grad_sync_trial_steps``, the least measured one among the closest estimates
    (``measure``: an algorithm's measured step in seconds, by default
    :func:`~jaxmoe.plan.grad_sync_trial.measured_step_seconds` on ``mesh``)."""
    costs = costs or ConvergenceCosts.load()
    cost, link = choice_cost_model(config, mesh)
    estimates = tuple(estimate(config, mesh, name, cost, costs) for name in ALGORITHMS)
    if config.train.grad_sync_trial_steps:
        if measure is None:
            measure = functools.partial(
                measured_step_seconds, config, mesh, batches=trial_batches(config)
            )
        estimates = tried(estimates, config.train.grad_sync_trial_margin, measure)
    measured = [e for e in estimates if e.measured_step_seconds is not None]
    best = min(measured or estimates, key=lambda e: e.time_to_loss)
    exact = min((e for e in estimates if e.exact), key=lambda e: e.step_seconds)
    if measured:
        reason = (
            f"measured step {best.measured_step_seconds * 1e3:.1f} ms x {best.convergence:.3f} "
            f"steps per exact step = {best.time_to_loss * 1e3:.1f} ms, the least of the "
            f"{len(measured)} algorithms tried ({config.train.grad_sync_trial_steps} steps each; "
            f"estimates within {config.train.grad_sync_trial_margin:.0%} of the best)"
        )
    elif best.exact:
        reason = f"fastest exact algorithm, estimated step {best.step_seconds * 1e3:.1f} ms"
        relaxed = [e for e in estimates if not e.exact and e.convergence is not None]
        if relaxed:
            runner = min(relaxed, key=lambda e: e.time_to_loss)
            reason += (
                f"; the best relaxed one, {runner.name}, {runner.step_seconds * 1e3:.1f} ms a "
                f"step x {runner.convergence:.3f} steps = {runner.time_to_loss * 1e3:.1f} ms"
            )
    else:
        reason = (
            f"estimated step {best.step_seconds * 1e3:.1f} ms x {best.convergence:.3f} steps "
            f"per exact step = {best.time_to_loss * 1e3:.1f} ms, against "
            f"{exact.step_seconds * 1e3:.1f} ms for the fastest exact algorithm ({exact.name})"
        )
    return GradSyncChoice(best.name, reason, link, costs.source, estimates)


def resolve_grad_sync(config: Config, mesh: Mesh) -> tuple[Config, GradSyncChoice | None]:
    """``config`` with ``train.grad_sync auto`` replaced by its choice (and the choice);
    any other ``config`` as it is."""
    if config.train.grad_sync != "auto":
        return config, None
    choice = choose_grad_sync(config, mesh)
    train = dataclasses.replace(config.train, grad_sync=choice.chosen)
    return dataclasses.replace(config, train=train), choice
