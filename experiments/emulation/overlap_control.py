"""The overlap control: does this cluster run communication while computation goes on?

A toy step per device, matmuls -> all_to_all -> matmuls, over every device of the
emulated hosts, in three forms:

- ``unchunked``: the whole batch at once;
- ``independent``: the batch in 8 chunks; chunk i's all-to-all could run while chunk
  i+1's first matmuls and chunk i-1's last ones compute;
- ``chained``: the same 8 chunks, each one's input made to depend on the previous one's
  output, so that nothing can overlap.

The host program compiles the three once and runs them in interleaved rounds, order
reversed every round (``run_control`` runs it on every host and returns a
``ControlResult``). Overlap is shown only where ``independent`` beats ``chained`` by more
than the spread of the rounds. With ``collectives="xla"`` the forms use
``lax.all_to_all`` (which XLA:CPU runs synchronously, and whose chunks' computation its
scheduler puts first); with ``"socket"``, the socket transport's ``SocketAllToAll``
(``experiments.emulation.socket_transport``), a start and a done
over TCP with the pipelined order pinned by data dependence. The command that runs it on
its own is ``python -m experiments.overlap_control``; ``experiments.cluster`` runs it
before the schedules.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from experiments.emulation.host_process import round_order
from experiments.emulation.hosts import EmulatedHosts, machine
from experiments.shared.spread import Spread, round_ratios

FORMS = ("independent", "chained", "unchunked")
COLLECTIVES = ("socket", "xla")


@dataclass(frozen=True)
class ControlProgram:
    """The toy step: ``rows`` x ``width`` float32 rows per device, ``layers`` matmuls
    (``width`` x ``width``, tanh) before and after the all-to-all, ``chunks`` chunks."""

    collectives: str = "socket"
    rows: int = 2048
    width: int = 512
    layers: int = 1
    chunks: int = 8

    def __post_init__(self) -> None:
        if self.collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got {self.collectives!r}")
        for name in ("rows", "width", "layers", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ControlSettings:
    """The program and where and how long it runs."""

    program: ControlProgram = field(default_factory=ControlProgram)
    hosts: int = 2
    devices_per_host: int = 1
    link_mbit: float = 200.0
    repeats: int = 10
    warmup: int = 2

    def __post_init__(self) -> None:
        devices = self.hosts * self.devices_per_host
        if self.program.rows % (self.program.chunks * devices):
            raise ValueError(
                f"rows ({self.program.rows}) must divide into {self.program.chunks} chunks of "
                f"one row per device each ({devices} devices)"
            )
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be at least 1 and warmup at least 0")

    @classmethod
    def for_cluster(
        cls, hosts: int, devices_per_host: int, link_mbit: float, repeats: int, warmup: int
    ) -> ControlSettings:
        """The control of a cluster run: the default program, its rows shared among each
        host's devices (the same work per host whatever the layout)."""
        default = ControlProgram()
        unit = default.chunks * hosts * devices_per_host
        rows = unit * max(1, default.rows // devices_per_host // unit)
        return cls(ControlProgram(rows=rows), hosts, devices_per_host, link_mbit, repeats, warmup)

    def to_json(self) -> dict:
        program = self.program
        return {
            "collectives": program.collectives,
            "hosts": self.hosts,
            "devices_per_host": self.devices_per_host,
            "link_mbit": self.link_mbit,
            "rows_per_device": program.rows,
            "width": program.width,
            "layers": program.layers,
            "chunks": program.chunks,
            "all_to_all_bytes_per_device": program.rows * program.width * 4,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "round_order": "listed order in even rounds, reversed in odd rounds",
            "machine": machine(),
        }


@dataclass(frozen=True)
class ControlResult:
    """Per-round step times in seconds of each form, and what was run."""

    seconds: dict[str, tuple[float, ...]]
    settings: ControlSettings

    def spread(self, form: str) -> Spread:
        return Spread.of(self.seconds[form])

    def speedups(self) -> list[float]:
        """Per round: chained over independent (above 1 where chunks overlap)."""
        return round_ratios(self.seconds["chained"], self.seconds["independent"])

    @property
    def overlap_shown(self) -> bool:
        """Independent beats chained in every round by more than either's own spread."""
        independent, chained = self.spread("independent"), self.spread("chained")
        margin = max(independent.high - independent.low, chained.high - chained.low)
        return chained.median - independent.median > margin and min(self.speedups()) > 1

    def summary(self) -> str:
        speedup = Spread.of(self.speedups())
        program = self.settings.program
        lines = [
            f"overlap control ({program.collectives} all_to_all, {program.chunks} chunks, "
            f"{len(self.seconds['chained'])} rounds; median [min-max] ms):"
        ]
        lines += [f"  {form:<12} {self.spread(form).format()}" for form in FORMS]
        verdict = "overlap shown" if self.overlap_shown else "NO overlap shown"
        lines.append(
            f"  chained / independent per round: {speedup.format(1, 3)}: {verdict} "
            "(independent must beat chained by more than the spread)"
        )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            **{form: [s * 1e3 for s in self.seconds[form]] for form in FORMS},
            "overlap_shown": self.overlap_shown,
            "chained_over_independent": self.speedups(),
            **self.settings.to_json(),
        }


# -- the per-device programs (run in each host process) --------------------------------------


def build_programs(mesh, axis: str, program: ControlProgram, transport=None) -> dict:
    """The three forms as jit-compiled whole-mesh functions of ``(x, w)``."""
    import jax
    from jax.sharding import PartitionSpec

    spec = (PartitionSpec(axis), PartitionSpec())
    return {
        name: jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=spec, out_specs=PartitionSpec(axis), check_vma=False
            )
        )
        for name, body in per_device_forms(axis, program, transport).items()
    }


def per_device_forms(axis: str, program: ControlProgram, transport=None) -> dict:
    """The three forms as per-device functions of ``(x, w)`` (inside a ``shard_map`` over
    ``axis``); without a ``transport``, with ``lax.all_to_all``. ``program``: anything with
    a ``ControlProgram``'s ``layers`` and ``chunks``."""
    import jax
    import jax.numpy as jnp

    from experiments.emulation.socket_transport import (
        SocketAllToAll,
        all_to_all_now,
        consume_token,
    )

    def compute(x, w):
        for _ in range(program.layers):
            x = jnp.tanh(x @ w)
        return x

    if transport is None:

        def exchange_now(h, key):
            return jax.lax.all_to_all(h, axis, 0, 0, tiled=True)

    else:
        socket_op = SocketAllToAll(transport, axis)

        def exchange_now(h, key):
            return all_to_all_now(socket_op, h, key=key, split_axis=0, concat_axis=0)

    def unchunked(x, w):
        return compute(exchange_now(compute(x, w), 0), w)

    def chained(x, w):
        outs, previous = [], None
        for i, chunk in enumerate(jnp.split(x, program.chunks)):
            if previous is not None:  # the previous chunk's result feeds this one
                chunk = chunk + 1e-30 * previous[0, 0]
            previous = compute(exchange_now(compute(chunk, w), 100 + i), w)
            outs.append(previous)
        return jnp.concatenate(outs)

    def independent_xla(x, w):
        chunks = jnp.split(x, program.chunks)
        return jnp.concatenate([unchunked(chunk, w) for chunk in chunks])

    def independent_socket(x, w):
        # Software-pipelined: chunk i's transfer runs while chunk i+1's first matmuls (and
        # the start of its transfer) and chunk i-1's last ones compute. The order is pinned
        # by data dependence: the window's work consumes start i's token, done i consumes
        # a value of the window's work.
        chunks = jnp.split(x, program.chunks)
        count, key = len(chunks), 200
        hidden = compute(chunks[0], w)
        token = socket_op.start(hidden, key=key, split_axis=0)
        received, outs = None, []
        for i in range(count):
            window = [token]
            if i + 1 < count:
                next_hidden = compute(consume_token(chunks[i + 1], token), w)
                next_token = socket_op.start(next_hidden, key=key + i + 1, split_axis=0)
                window.append(next_token)
            if received is not None:
                outs.append(compute(consume_token(received, token), w))
                window.append(outs[-1][0, 0])
            received = socket_op.done(
                token, sum(window), key=key + i, like=hidden, split_axis=0, concat_axis=0
            )
            if i + 1 < count:
                hidden, token = next_hidden, next_token
        outs.append(compute(received, w))
        return jnp.concatenate(outs)

    return {
        "independent": independent_xla if transport is None else independent_socket,
        "chained": chained,
        "unchunked": unchunked,
    }


def run_control(hosts: EmulatedHosts, settings: ControlSettings) -> ControlResult:
    """The control on every host (one run of every host)."""
    out = hosts.path("control.json")
    program = settings.program
    args = ["--json", str(out), "--devices-per-host", str(settings.devices_per_host)]
    args += ["--collectives", program.collectives, "--rows", str(program.rows)]
    args += ["--width", str(program.width), "--layers", str(program.layers)]
    args += ["--chunks", str(program.chunks), "--repeats", str(settings.repeats)]
    args += ["--warmup", str(settings.warmup), "--link-mbit", str(settings.link_mbit)]
    hosts.run("overlap-control", args, module=__name__)
    seconds = json.loads(out.read_text())
    return ControlResult({form: tuple(seconds[form]) for form in FORMS}, settings)


def main(argv: list[str] | None = None) -> int:
    """The host program: compile the three forms, time interleaved rounds, process 0
    writes the seconds of each form's rounds."""
    parser = argparse.ArgumentParser(description="The overlap control on one host.")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--devices-per-host", type=int, required=True)
    parser.add_argument("--collectives", choices=COLLECTIVES, default="socket")
    for name in ("rows", "width", "layers", "chunks", "repeats", "warmup"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--link-mbit", type=float, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    args = parser.parse_args(argv)
    program = ControlProgram(args.collectives, args.rows, args.width, args.layers, args.chunks)

    # No model configuration to prepare: the devices and the distributed runtime only.
    from jaxmoe.parallel.distributed import DistributedConfig, initialize
    from jaxmoe.parallel.host_devices import ensure_host_devices

    ensure_host_devices(args.devices_per_host)
    initialize(DistributedConfig(args.coordinator, args.num_processes, args.process_id))
    # This program has no step to finish: SIGTERM ends it at once, also while a thread
    # waits in a host callback (the preemption handler that initialize installs only takes
    # note).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    axis = "devices"
    mesh = jax.make_mesh((jax.device_count(),), (axis,))
    transport = None
    if program.collectives == "socket":
        from experiments.emulation.socket_transport import SocketTransport

        transport = SocketTransport.connect(mesh, link_mbit=args.link_mbit)
    programs = build_programs(mesh, axis, program, transport)
    rows = program.rows * jax.device_count()
    host = np.random.default_rng(0)
    x = jax.make_array_from_callback(
        (rows, program.width),
        NamedSharding(mesh, PartitionSpec(axis)),
        lambda index: host.standard_normal((rows, program.width), np.float32)[index],
    )
    w = jax.device_put(
        jnp.asarray(
            host.standard_normal((program.width, program.width), np.float32) / program.width**0.5
        ),
        NamedSharding(mesh, PartitionSpec()),
    )
    compiled = {name: fn.lower(x, w).compile() for name, fn in programs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in FORMS}
    for round_index in range(args.warmup + args.repeats):
        for name in round_order(list(FORMS), round_index):
            started = time.perf_counter()
            jax.block_until_ready(compiled[name](x, w))
            if round_index >= args.warmup:
                seconds[name].append(time.perf_counter() - started)
    if jax.process_index() == 0:
        args.json.write_text(json.dumps(seconds))
    if transport is not None:
        transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
