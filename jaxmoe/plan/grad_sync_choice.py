"""``train.grad_sync auto``: the gradient-sync algorithm the cost model estimates fastest.

Each algorithm's train step is captured (``scheduling.capture``) and every op
of it costed by the scheduling layer's cost model on the link the run is told:

- hosts: :func:`~jaxmoe.parallel.grad_sync.hierarchical.devices_per_host`
  (``train.grad_sync_devices_per_host``, or one host per process);
- the link between hosts: ``schedule.link_mbit`` (shared by a host's
  devices), else the profile's node link (a multi-node profile) or its link;
  inside a host, a multi-node profile's device link, or for a flat profile the
  device's memory bandwidth (devices of one host exchange through memory);
- ``schedule.link_curves``: collectives whose kind and group size the
  measured curves cover cost what the curves say.

The estimate of a step is the sum of its ops' seconds (no overlap of compute
and communication: XLA:CPU runs collectives synchronously; on other backends
``delayed`` is credited with hiding its reduction behind the next step's
compute). The fastest exact algorithm (``allreduce``, ``bucketed``,
``hierarchical``) is chosen unless a relaxed one is estimated at least
:data:`RELAXED_SPEEDUP` times faster per step: a relaxed algorithm may need
more steps to reach the same loss, which a per-step estimate cannot see.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.sharding import Mesh

import scheduling
from jaxmoe.config import Config
from jaxmoe.parallel.grad_sync import ALGORITHMS, EXACT
from jaxmoe.parallel.grad_sync.decentralized import MIX_SCOPE
from jaxmoe.parallel.grad_sync.hierarchical import devices_per_host
from jaxmoe.train.scheduled import capture_train_step

# How much faster per step (estimated) a relaxed algorithm must be to be chosen over the
# best exact one. A rule, not a measurement: slower convergence per step has to be paid for.
RELAXED_SPEEDUP = 1.2
# The name scopes of the synchronisation's ops: gradient reductions, parameter mixing.
SYNC_SCOPES = ("grad_reduce", MIX_SCOPE)
CHOICE_FILE = "grad_sync_choice.json"


@dataclass(frozen=True)
class AlgorithmEstimate:
    name: str
    exact: bool
    sync_seconds: float  # the gradient-sync ops (collectives and their compute) of one step
    step_seconds: float  # the whole step, the sync's exposed part included


@dataclass(frozen=True)
class GradSyncChoice:
    chosen: str
    reason: str
    link: str  # the link the estimates are for, in words
    estimates: tuple[AlgorithmEstimate, ...]

    def table(self) -> str:
        lines = [
            f"grad_sync auto -> {self.chosen}: {self.reason}",
            f"  link: {self.link}",
            "  algorithm            exact  sync (ms)  step (ms)",
        ]
        for e in self.estimates:
            mark = " <-" if e.name == self.chosen else ""
            lines.append(
                f"  {e.name:<20} {'yes' if e.exact else 'no':<5} {e.sync_seconds * 1e3:>9.1f} "
                f"{e.step_seconds * 1e3:>10.1f}{mark}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def choice_cost_model(config: Config, mesh: Mesh) -> tuple[scheduling.CostModel, str]:
    """The cost model of the link ``config`` describes, and that link in words."""
    train, schedule = config.train, config.schedule
    base = scheduling.PROFILES[schedule.profile]
    per_host = devices_per_host(train.grad_sync_devices_per_host, mesh)
    hosts = mesh.devices.size // per_host
    told = schedule.link_mbit * 1e6 / 8 if schedule.link_mbit else None
    if hosts == 1:
        profile = base.with_link(told) if told else base
    elif base.devices_per_node:
        profile = dataclasses.replace(
            base,
            devices_per_node=per_host,
            node_link_bytes_per_s=told or base.node_link_bytes_per_s,
        )
    else:
        profile = dataclasses.replace(
            base,
            devices_per_node=per_host,
            link_bytes_per_s=base.memory_bytes_per_s,
            node_link_bytes_per_s=told or base.link_bytes_per_s,
            node_link_latency_s=base.link_latency_s,
        )
    words = f"{hosts} host(s) x {per_host} devices, profile {base.name}"
    if hosts > 1:
        words += f", {profile.node_link_bytes_per_s * 8 / 1e6:g} Mbit/s between hosts"
    curves = None
    if schedule.link_curves:
        curves = scheduling.CollectiveCurves.load(schedule.link_curves)
        words += f", measured curves {Path(schedule.link_curves).name}"
    return scheduling.CostModel(profile, dict(mesh.shape), curves), words


def estimate(config: Config, mesh: Mesh, name: str, cost: scheduling.CostModel):
    with_algorithm = dataclasses.replace(
        config, train=dataclasses.replace(config.train, grad_sync=name)
    )
    program, _ = capture_train_step(with_algorithm, mesh)
    sync = compute = communication = 0.0
    for op in program.ops:
        seconds = cost.seconds(op)
        if any(scope in op.name_stack for scope in SYNC_SCOPES):
            sync += seconds
        elif op.is_collective:
            communication += seconds
        else:
            compute += seconds
    exposed = sync
    if name == "delayed" and jax.default_backend() != "cpu":
        # Its reduction has the next step's forward and backward to finish behind.
        exposed = max(0.0, sync - compute)
    return AlgorithmEstimate(name, name in EXACT, sync, compute + communication + exposed)


def choose_grad_sync(config: Config, mesh: Mesh) -> GradSyncChoice:
    cost, link = choice_cost_model(config, mesh)
    estimates = tuple(estimate(config, mesh, name, cost) for name in ALGORITHMS)
    exact = min((e for e in estimates if e.exact), key=lambda e: e.step_seconds)
    relaxed = min((e for e in estimates if not e.exact), key=lambda e: e.step_seconds)
    speedup = exact.step_seconds / relaxed.step_seconds
    if speedup >= RELAXED_SPEEDUP:
        chosen = relaxed.name
        reason = (
            f"estimated step {relaxed.step_seconds * 1e3:.1f} ms, {speedup:.2f}x faster than "
            f"the best exact algorithm ({exact.name}, {exact.step_seconds * 1e3:.1f} ms; "
            f"a relaxed one must be {RELAXED_SPEEDUP:g}x faster)"
        )
    else:
        chosen = exact.name
        reason = (
            f"fastest exact algorithm, estimated step {exact.step_seconds * 1e3:.1f} ms; the "
            f"fastest relaxed one ({relaxed.name}, {relaxed.step_seconds * 1e3:.1f} ms) is "
            f"{speedup:.2f}x faster, under the {RELAXED_SPEEDUP:g}x a relaxed one must gain"
        )
    return GradSyncChoice(chosen, reason, link, estimates)


def resolve_grad_sync(config: Config, mesh: Mesh) -> tuple[Config, GradSyncChoice | None]:
    """``config`` with ``train.grad_sync auto`` replaced by its choice (and the choice);
    any other ``config`` as it is."""
    if config.train.grad_sync != "auto":
        return config, None
    choice = choose_grad_sync(config, mesh)
    train = dataclasses.replace(config.train, grad_sync=choice.chosen)
    return dataclasses.replace(config, train=train), choice
