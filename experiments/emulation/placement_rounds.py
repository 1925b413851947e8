"""Step times of expert placements at equal buffers, interleaved, on every emulated host.

The host program (run on every host by ``run_placement_rounds``, for
``experiments.placement_cluster``)::

    python -m experiments.emulation.placement_rounds --config CONFIG.json --rounds 10 \\
        --warmup 2 --json OUT.json [--coordinator HOST:PORT --num-processes N --process-id I]

``CONFIG`` has replica slots (``moe.slots_per_device`` above the experts per device) and
``moe.rebalance_every`` > 0. Three variants train side by side, each from the same initial
state, every round on the same batch, the order reversed every other round (as in
``experiments.emulation.step_rounds``):

- ``no replicas``: ``moe.slots_per_device`` = experts per device, today's step. Capacity
  is per slot and sized over all slots, so its per-device buffers (and all-to-all bytes)
  equal the others'.
- ``static``: the replica slots, every expert with the same number of copies, never moved.
- ``dynamic``: the same compiled step as ``static``; after each step, what the training
  loop does between steps (:func:`jaxmoe.train.loop.rebalance`): every
  ``moe.rebalance_every`` steps the planner re-places the copies from the window's
  routing counts and the new table is put on the devices. That time is part of its round.

Process 0 writes, per variant, the seconds of each timed round, the dropped fraction of
each step, and for ``dynamic`` the seconds its re-planning took and the slots it changed:
a ``PlacementRounds``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.emulation.host_process import round_order, rounds_parser, start_host, train_batches
from experiments.emulation.hosts import EmulatedHosts
from jaxmoe.train.resolved import resolve

VARIANTS = ("no replicas", "static", "dynamic")


@dataclass(frozen=True)
class PlacementRounds:
    """Per variant, the seconds of each timed round and each step's dropped fraction; for
    ``dynamic``, each re-planning's seconds and the slots it changed."""

    seconds: dict[str, tuple[float, ...]]
    dropped_fraction: dict[str, tuple[float, ...]]
    planning_s: tuple[float, ...]
    changed_slots: tuple[int, ...]

    @classmethod
    def from_json(cls, data: dict) -> PlacementRounds:
        return cls(
            {name: tuple(values) for name, values in data["seconds"].items()},
            {name: tuple(values) for name, values in data["dropped_fraction"].items()},
            tuple(data["planning_s"]),
            tuple(data["changed_slots"]),
        )

    def to_json(self) -> dict:
        return {
            "seconds": {name: list(values) for name, values in self.seconds.items()},
            "dropped_fraction": {
                name: list(values) for name, values in self.dropped_fraction.items()
            },
            "planning_s": list(self.planning_s),
            "changed_slots": list(self.changed_slots),
        }


def variant_configs(config) -> dict:
    """The three variants' configs, from one with replica slots and re-planning."""
    from jaxmoe.config import ConfigError

    if not config.replica_slots or not config.moe.rebalance_every:
        raise ConfigError(
            "placement rounds need replica slots and re-planning: pass "
            "--moe.slots_per_device above the experts per device and --moe.rebalance_every N"
        )
    moe, train = config.moe, config.train
    return {
        "no replicas": dataclasses.replace(
            config, moe=dataclasses.replace(moe, slots_per_device=None, rebalance_every=0)
        ),
        "static": dataclasses.replace(config, moe=dataclasses.replace(moe, rebalance_every=0)),
        # The loop skips re-planning after its last step; these rounds have no last step.
        "dynamic": dataclasses.replace(config, train=dataclasses.replace(train, steps=2**31 - 1)),
    }


def run_placement_rounds(
    hosts: EmulatedHosts, config_path: Path, rounds: int, warmup: int
) -> PlacementRounds:
    """The three variants in interleaved rounds on every host."""
    out = hosts.path("placement-rounds.json")
    args = ["--config", str(config_path), "--json", str(out)]
    args += ["--rounds", str(rounds), "--warmup", str(warmup)]
    hosts.run("placement-rounds", args, module=__name__)
    return PlacementRounds.from_json(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    args = rounds_parser(__doc__.splitlines()[0]).parse_args(argv)
    prepared = start_host(args)
    config, mesh = prepared.config, prepared.mesh
    sampler = train_batches(config)
    configs = variant_configs(config)

    import jax
    import numpy as np

    from jaxmoe.data.batches import put_on_mesh
    from jaxmoe.placement.planner import PlacementLog
    from jaxmoe.train.logs.metrics import host_row
    from jaxmoe.train.loop import rebalance
    from jaxmoe.train.scheduled import scheduled_train_step
    from jaxmoe.train.state import init_train_state

    tokens = config.train.batch_size * config.model.seq_len
    no_log = PlacementLog(None, 0, active=False)
    # static and dynamic run one compiled step: only the table they pass it differs.
    shared = scheduled_train_step(resolve(configs["static"], mesh)).compile()
    steps = {
        "no replicas": scheduled_train_step(resolve(configs["no replicas"], mesh)).compile(),
        "static": shared,
        "dynamic": shared,
    }
    states = {name: init_train_state(resolve(configs[name], mesh)) for name in VARIANTS}
    history: list[dict] = []  # dynamic's rows, the planner's window
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    dropped: dict[str, list[float]] = {name: [] for name in VARIANTS}
    planning_s: list[float] = []
    changed_slots: list[int] = []
    for round_index in range(args.warmup + args.rounds):
        batch = put_on_mesh(sampler, round_index, mesh)
        jax.block_until_ready(batch)
        timed = round_index >= args.warmup
        for name in round_order(list(VARIANTS), round_index):
            if name == "dynamic":
                before = np.asarray(jax.device_get(states[name].placement))
            started = time.perf_counter()
            states[name], metrics = steps[name](states[name], batch)
            metrics = jax.device_get(metrics)  # waits for the step, as the loop does
            stepped = time.perf_counter()
            if name == "dynamic":
                history.append(host_row(round_index, metrics, stepped - started, tokens))
                states[name] = rebalance(
                    states[name], history, configs[name], round_index + 1, no_log
                )
                jax.block_until_ready(states[name].placement)
            finished = time.perf_counter()
            if not timed:
                continue
            seconds[name].append(finished - started)
            dropped[name].append(float(metrics["dropped_fraction"]))
            if name == "dynamic":
                planning_s.append(finished - stepped)
                after = np.asarray(jax.device_get(states[name].placement))
                changed_slots.append(int(np.sum(before != after)))
    if jax.process_index() == 0:
        report = {
            "seconds": seconds,
            "dropped_fraction": dropped,
            "planning_s": planning_s,
            "changed_slots": changed_slots,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
