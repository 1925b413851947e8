"""Training-step times of several schedules, interleaved: compile each once, then run rounds.

The host program (run on every emulated host by ``run_step_rounds``)::

    python -m experiments.emulation.step_rounds --config CONFIG.json --schedules none,dw \\
        --rounds 10 --warmup 2 --json OUT.json [--trace DIR] [--coordinator HOST:PORT \\
        --num-processes N --process-id I] [--experimental.NAME VALUE ...]

Every schedule's step is compiled once in this process, each with its own train state
(the same initial state for all). Then each round runs one training step of every
schedule, in the listed order in even rounds and reversed in odd ones, so that a drift of
the machine (other work on its cores, a warming cache) falls on every schedule alike and
a schedule's position in the round does not favour it. The research options
(``experiments.emulation.experimental``: the socket transport) go to every schedule's
step. All schedules of a round train on
the same batch. ``--warmup`` rounds run first and are not timed. Process 0 writes, per
schedule, the seconds of each timed round (index r of every list is round r), the order
of every round and each compilation's seconds: a ``StepRounds``.

With ``--trace DIR``, after the rounds each schedule runs ``TRACED_STEPS`` more steps under
``jax.profiler``, every process tracing its own devices into
``DIR/<schedule>/process_<i>``, and process 0 writes the compiled module's text beside
them (``DIR/<schedule>/step.hlo.txt``): what ``scheduling.read_trace`` and
``scheduling.traced_costs`` read to take the step's op costs from inside it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.emulation.experimental import Experimental
from experiments.emulation.host_process import round_order, rounds_parser, start_host, train_batches
from experiments.emulation.hosts import EmulatedHosts
from jaxmoe.train.resolved import resolve

TRACED_STEPS = 2


@dataclass(frozen=True)
class StepRounds:
    """Per schedule, the seconds of each timed round; the order of each round; per
    schedule, the seconds its compilation took."""

    seconds: dict[str, tuple[float, ...]]
    orders: tuple[tuple[str, ...], ...]
    compile_s: dict[str, float]

    @classmethod
    def from_json(cls, data: dict) -> StepRounds:
        return cls(
            {name: tuple(values) for name, values in data["seconds"].items()},
            tuple(tuple(order) for order in data["orders"]),
            dict(data["compile_s"]),
        )


def with_schedule(config, schedule: str):
    """``config`` with its schedule section set from a cluster entry ``NAME`` or ``NAME:N``
    (N: the chunk count or pipelining degree)."""
    name, _, chunks = schedule.partition(":")
    section = dataclasses.replace(
        config.schedule, name=name, partition_chunks=int(chunks) if chunks else None
    )
    return dataclasses.replace(config, schedule=section)


def run_step_rounds(
    hosts: EmulatedHosts,
    config_path: Path,
    schedules: list[str],
    rounds: int,
    warmup: int,
    trace: Path | None = None,
    experimental: Experimental | None = None,
) -> StepRounds:
    """The schedules' training steps in interleaved rounds on every host (``trace``: then
    each schedule's traced steps there, see the module; ``experimental``: the research
    options of every step)."""
    out = hosts.path("rounds.json")
    args = ["--config", str(config_path), "--schedules", ",".join(schedules)]
    args += ["--rounds", str(rounds), "--warmup", str(warmup), "--json", str(out)]
    if trace is not None:
        args += ["--trace", str(trace)]
    if experimental is not None:
        args += experimental.argv()
    hosts.run("step-rounds", args, module=__name__)
    return StepRounds.from_json(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = rounds_parser(__doc__.splitlines()[0])
    parser.add_argument("--schedules", required=True, help="comma-separated NAME or NAME:N")
    parser.add_argument("--trace", type=Path, help="trace each schedule's steps here")
    argv, experimental = Experimental.split(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    prepared = start_host(args)
    config, mesh = prepared.config, prepared.mesh
    sampler = train_batches(config)

    import jax

    from jaxmoe.data.batches import put_on_mesh
    from jaxmoe.train.scheduled import scheduled_train_step
    from jaxmoe.train.state import init_train_state

    steps, states, compile_s = {}, {}, {}
    for schedule in schedules:
        started = time.perf_counter()
        options = experimental.options()
        steps[schedule] = scheduled_train_step(
            resolve(with_schedule(config, schedule), mesh), options
        ).compile()
        compile_s[schedule] = time.perf_counter() - started
        states[schedule] = init_train_state(resolve(config, mesh))

    seconds: dict[str, list[float]] = {schedule: [] for schedule in schedules}
    orders = []
    for round_index in range(args.warmup + args.rounds):
        batch = put_on_mesh(sampler, round_index, mesh)
        jax.block_until_ready(batch)
        order = round_order(schedules, round_index)
        for schedule in order:
            started = time.perf_counter()
            states[schedule], metrics = steps[schedule](states[schedule], batch)
            jax.block_until_ready((states[schedule], metrics))
            if round_index >= args.warmup:
                seconds[schedule].append(time.perf_counter() - started)
        if round_index >= args.warmup:
            orders.append(order)
    if args.trace is not None:
        for schedule in schedules:
            trace_steps(steps[schedule], states[schedule], batch, args.trace / schedule)
    if jax.process_index() == 0:
        report = {"seconds": seconds, "orders": orders, "compile_s": compile_s}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def trace_steps(step, state, batch, directory: Path) -> None:
    """``TRACED_STEPS`` steps of ``step`` under ``jax.profiler`` (this process's devices, into
    ``directory/process_<i>``); process 0 also writes the compiled module's text."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (directory / "step.hlo.txt").write_text(step.as_text())
    jax.block_until_ready(state)
    with jax.profiler.trace(str(directory / f"process_{jax.process_index()}")):
        for _ in range(TRACED_STEPS):
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))


if __name__ == "__main__":
    sys.exit(main())
