"""The overlap control: does this cluster run communication while computation goes on?

    sudo python -m experiments.overlap_control [--collectives socket|xla] [--json FILE]

A toy step per device, matmuls -> all_to_all -> matmuls, over every device of 2 emulated
hosts (1 device each by default) joined by a calibrated, shaped link, in three forms:

- ``unchunked``: the whole batch at once;
- ``independent``: the batch in 8 chunks; chunk i's all-to-all could run while chunk
  i+1's first matmuls and chunk i-1's last ones compute;
- ``chained``: the same 8 chunks, each one's input made to depend on the previous one's
  output, so that nothing can overlap.

The three are compiled once per host process and run in interleaved rounds, order
reversed every round. Overlap is shown only where ``independent`` beats ``chained`` by
more than the spread of the rounds. ``--collectives xla`` uses ``lax.all_to_all`` (which
XLA:CPU runs synchronously, and whose chunks' computation its scheduler puts first);
``--collectives socket`` uses ``scheduling.runtime.socket_all_to_all``, a start and a done over
TCP with the pipelined order pinned by data dependence. ``--json`` writes the per-round
step times in milliseconds under ``independent``, ``chained`` and ``unchunked``, with the
configuration, the link's calibration and the command.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.hosts import Cluster, machine
from experiments.link_calibration import calibrate_link, ensure_calibrated
from experiments.netns import EmulatedNetwork, LinkShape, namespaces_available
from experiments.spread import Spread, round_ratios

FORMS = ("independent", "chained", "unchunked")


@dataclass(frozen=True)
class ControlResult:
    """Per-round step times in seconds of each form, and what was run."""

    seconds: dict[str, list[float]]
    settings: dict

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
        lines = [
            f"overlap control ({self.settings['collectives']} all_to_all, "
            f"{self.settings['chunks']} chunks, {len(self.seconds['chained'])} rounds; "
            "median [min-max] ms):"
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
            **self.settings,
        }


# -- the per-device programs (run in each host process) --------------------------------------


def build_programs(mesh, axis: str, args: argparse.Namespace, transport=None) -> dict:
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
        for name, body in per_device_forms(axis, args, transport).items()
    }


def per_device_forms(axis: str, args: argparse.Namespace, transport=None) -> dict:
    """The three forms as per-device functions of ``(x, w)`` (inside a ``shard_map`` over
    ``axis``); without a ``transport``, with ``lax.all_to_all``."""
    import jax
    import jax.numpy as jnp

    from scheduling import SocketAllToAll, all_to_all_now, consume_token

    def compute(x, w):
        for _ in range(args.layers):
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
        for i, chunk in enumerate(jnp.split(x, args.chunks)):
            if previous is not None:  # the previous chunk's result feeds this one
                chunk = chunk + 1e-30 * previous[0, 0]
            previous = compute(exchange_now(compute(chunk, w), 100 + i), w)
            outs.append(previous)
        return jnp.concatenate(outs)

    def independent_xla(x, w):
        chunks = jnp.split(x, args.chunks)
        return jnp.concatenate([unchunked(chunk, w) for chunk in chunks])

    def independent_socket(x, w):
        # Software-pipelined: chunk i's transfer runs while chunk i+1's first matmuls (and
        # the start of its transfer) and chunk i-1's last ones compute. The order is pinned
        # by data dependence: the window's work consumes start i's token, done i consumes
        # a value of the window's work.
        chunks = jnp.split(x, args.chunks)
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


def worker(args: argparse.Namespace) -> int:
    """One host process: compile the three forms, time interleaved rounds, write process 0's."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from experiments.step_rounds import round_order

    axis = "devices"
    mesh = jax.make_mesh((jax.device_count(),), (axis,))
    transport = None
    if args.collectives == "socket":
        from scheduling import SocketTransport

        transport = SocketTransport.connect(mesh)
    programs = build_programs(mesh, axis, args, transport)
    rows = args.rows * jax.device_count()
    host = np.random.default_rng(0)
    x = jax.make_array_from_callback(
        (rows, args.width),
        NamedSharding(mesh, PartitionSpec(axis)),
        lambda index: host.standard_normal((rows, args.width), np.float32)[index],
    )
    w = jax.device_put(
        jnp.asarray(host.standard_normal((args.width, args.width), np.float32) / args.width**0.5),
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
        args.out.write_text(json.dumps(seconds))
    if transport is not None:
        transport.close()
    return 0


# -- the launcher ------------------------------------------------------------------------------


def settings(args: argparse.Namespace) -> dict:
    exchanged = args.rows * args.width * 4
    return {
        "collectives": args.collectives,
        "hosts": args.hosts,
        "devices_per_host": args.devices_per_host,
        "link_mbit": args.link_mbit,
        "rows_per_device": args.rows,
        "width": args.width,
        "layers": args.layers,
        "chunks": args.chunks,
        "all_to_all_bytes_per_device": exchanged,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "round_order": "listed order in even rounds, reversed in odd rounds",
        "machine": machine(),
    }


def worker_argv(args: argparse.Namespace, out: Path) -> list[str]:
    argv = ["--worker", "--out", str(out), "--collectives", args.collectives]
    for flag in ("rows", "width", "layers", "chunks", "repeats", "warmup", "devices_per_host"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv


def run_control(cluster: Cluster, args: argparse.Namespace) -> ControlResult:
    """The control on ``cluster``'s hosts (the launcher's part; one run of every host)."""
    out = cluster.workdir / f"{cluster.name}-control.json"
    cluster.run("overlap-control", worker_argv(args, out), module="experiments.overlap_control")
    return ControlResult(json.loads(out.read_text()), settings(args))


def cluster_control_args(
    devices_per_host: int, hosts: int, link_mbit: float, repeats: int, warmup: int
) -> argparse.Namespace:
    """The control's settings for a cluster run: the default program, its rows shared
    among each host's devices (the same work per host whatever the layout)."""
    parser = argparse.ArgumentParser()
    add_program_arguments(parser)
    args = parser.parse_args([])
    args.rows = max(args.chunks * hosts * devices_per_host, args.rows // devices_per_host)
    args.hosts, args.devices_per_host, args.link_mbit = hosts, devices_per_host, link_mbit
    args.repeats, args.warmup = repeats, warmup
    return args


def add_program_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collectives", choices=("socket", "xla"), default="socket")
    parser.add_argument("--rows", type=int, default=2048, help="rows per device")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1, help="matmuls before and after")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.overlap_control", description=__doc__.splitlines()[0]
    )
    add_program_arguments(parser)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices-per-host", type=int, default=1)
    parser.add_argument("--link-mbit", type=float, default=200.0)
    parser.add_argument("--allow-uncalibrated", action="store_true")
    parser.add_argument("--json", type=Path, help="write the per-round times (ms) here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from jaxmoe.parallel.host_devices import ensure_host_devices

        ensure_host_devices(args.devices_per_host)
        return worker(args)
    if args.rows % (args.chunks * args.hosts * args.devices_per_host):
        parser.error("--rows must divide into --chunks pieces of one row per device each")
    available, reason = namespaces_available()
    if not available:
        print(f"overlap_control: cannot create network namespaces: {reason}", file=sys.stderr)
        return 2
    command = "python -m experiments.overlap_control " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    with (
        tempfile.TemporaryDirectory(prefix="jaxmoe-control-") as tmp,
        EmulatedNetwork(args.hosts, LinkShape(rate_mbit=args.link_mbit)) as network,
    ):
        calibration = calibrate_link(network)
        if not ensure_calibrated(calibration, allow_uncalibrated=args.allow_uncalibrated):
            return 3
        result = run_control(Cluster(network, Path(tmp), "shaped"), args)
    print(result.summary())
    if args.json is not None:
        report = {"command": command, **result.to_json()}
        report["link_calibration"] = calibration.to_dict()
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
