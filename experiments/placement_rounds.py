"""Step times of expert placements at equal buffers, interleaved (one emulated host's process).

    python -m experiments.placement_rounds --config CONFIG.json --rounds 10 --warmup 2 \\
        --json OUT.json [--coordinator HOST:PORT --num-processes N --process-id I]

``CONFIG`` has replica slots (``moe.slots_per_device`` above the experts per device) and
``moe.rebalance_every`` > 0. Three variants train side by side, each from the same initial
state, every round on the same batch, the order reversed every other round (as in
``experiments.step_rounds``):

- ``no replicas``: ``moe.slots_per_device`` = experts per device, today's step. Capacity
  is per slot and sized over all slots, so its per-device buffers (and all-to-all bytes)
  equal the others'.
- ``static``: the replica slots, every expert with the same number of copies, never moved.
- ``dynamic``: the same compiled step as ``static``; after each step, what the training
  loop does between steps (:func:`jaxmoe.train.loop.rebalance`): every
  ``moe.rebalance_every`` steps the planner re-places the copies from the window's
  routing counts and the new table is put on the devices. That time is part of its round.

Process 0 writes, per variant, the seconds of each timed round, the dropped fraction of
each step, and for ``dynamic`` the seconds its re-planning took and the slots it changed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from experiments.step_rounds import round_order, rounds_parser, start_host

VARIANTS = ("no replicas", "static", "dynamic")


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


def main(argv: list[str] | None = None) -> int:
    args = rounds_parser(__doc__.splitlines()[0]).parse_args(argv)
    config, mesh, sampler = start_host(args)
    configs = variant_configs(config)

    import jax
    import numpy as np

    from jaxmoe.train.data import put_on_mesh
    from jaxmoe.train.loop import rebalance
    from jaxmoe.train.metrics import host_row
    from jaxmoe.train.placement_planner import PlacementLog
    from jaxmoe.train.scheduled import plan_train_step
    from jaxmoe.train.state import init_train_state

    tokens = config.train.batch_size * config.model.seq_len
    no_log = PlacementLog(None, 0, active=False)
    # static and dynamic run one compiled step: only the table they pass it differs.
    shared = plan_train_step(configs["static"], mesh).compile()
    steps = {
        "no replicas": plan_train_step(configs["no replicas"], mesh).compile(),
        "static": shared,
        "dynamic": shared,
    }
    states = {name: init_train_state(configs[name], mesh) for name in VARIANTS}
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
