"""The emulated cluster's socket all-to-all: bit for bit the all-to-all, and a start that
returns before the transfer so that computation placed before the done runs during it."""

from __future__ import annotations

import argparse
import itertools
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from experiments.emulation.socket_transport import (
    SocketAllToAll,
    SocketAllToAlls,
    SocketTransport,
    all_to_all_now,
    consume_token,
)
from scheduling.program.jax_adapter import HOST_CALLBACK_NAMES

REPO_ROOT = Path(__file__).resolve().parents[3]


def _run(mesh, spec, body, x):
    mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return jax.jit(mapped)(x)


@pytest.mark.parametrize(("split_axis", "concat_axis"), [(0, 0), (1, 0), (0, 1)])
def test_equals_lax_all_to_all_bit_for_bit_on_every_device(split_axis, concat_axis):
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    spec = PartitionSpec(("data", "expert"))
    x = jax.random.normal(jax.random.key(0), (8 * 4, 8, 3)).at[0, 0, 0].set(-0.0)
    x = jax.device_put(x, NamedSharding(mesh, spec))
    transport = SocketTransport(mesh, connections={})
    op = SocketAllToAll(transport, "expert")

    def reference(block):
        return jax.lax.all_to_all(block, "expert", split_axis, concat_axis, tiled=True)

    def pipelined(block):
        token = op.start(block, key=1, split_axis=split_axis)
        busy = jnp.tanh(consume_token(block, token))  # computation inside the window
        return op.done(
            token, busy, key=1, like=block, split_axis=split_axis, concat_axis=concat_axis
        )

    expected = _run(mesh, spec, reference, x)
    for _ in range(2):  # a second step reuses the keys
        chex.assert_trees_all_equal(_run(mesh, spec, pipelined, x), expected)
    back_to_back = _run(
        mesh,
        spec,
        lambda b: all_to_all_now(op, b, key=2, split_axis=split_axis, concat_axis=concat_axis),
        x,
    )
    chex.assert_trees_all_equal(back_to_back, expected)


def test_consuming_a_token_keeps_every_bit():
    x = jnp.array([-0.0, 0.0, 1.5, jnp.nan, -jnp.inf], jnp.float32)
    kept = consume_token(x, jnp.float32(0))
    np.testing.assert_array_equal(np.asarray(kept).view(np.uint32), np.asarray(x).view(np.uint32))


class _DelayedTransport(SocketTransport):
    """In one process, each piece arrives ``delay_s`` after its send (a stand-in link on
    which transfers take time but no core); it records when each device first sent to
    each collective and when the last piece of each collective arrived at each device."""

    def __init__(self, mesh, delay_s: float):
        super().__init__(mesh, connections={})
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.sent: dict = {}  # (key, source) -> when the source's first piece left
        self.arrived: dict = {}  # (key, destination) -> when its last piece arrived

    def send(self, key, source, destination, piece, trim=False):
        payload = np.ascontiguousarray(piece).tobytes()
        with self.lock:
            self.sent.setdefault((key, source), time.perf_counter())

        def deliver():
            with self.lock:
                self.arrived[key, destination] = time.perf_counter()
            self.mailbox.put((key, source, destination), payload)

        threading.Timer(self.delay_s, deliver).start()

    def overlapped_starts(self) -> dict[int, int]:
        """Per device: how many of its collectives it started before the one it started
        last had all arrived at it (0: one at a time)."""
        counts = {}
        for device in {source for _, source in self.sent}:
            keys = sorted((at, key) for (key, source), at in self.sent.items() if source == device)
            counts[device] = sum(
                started < self.arrived[previous, device]
                for (_, previous), (started, _) in itertools.pairwise(keys)
            )
        return counts


def test_the_pipelined_chunks_overlap_their_transfers_and_chained_ones_do_not():
    """Independent chunks: done i waits for start i+1, so every device starts a transfer
    while its previous one is in flight (if XLA moved each done next to its start, none
    would, as when chained). The test reads the order of sends and arrivals, not durations:
    a chained start follows its input's arrival by construction."""
    from experiments.emulation.overlap_control import build_programs

    mesh = jax.make_mesh((8,), ("devices",))
    args = argparse.Namespace(rows=64, width=32, layers=1, chunks=4)
    x = jax.device_put(
        jnp.ones((64 * 8, 32), jnp.float32), NamedSharding(mesh, PartitionSpec("devices"))
    )
    w = jnp.eye(32, dtype=jnp.float32)
    overlapped = {}
    for name in ("independent", "chained"):
        # Slow enough that no stall of the host delivers a piece before the next start.
        transport = _DelayedTransport(mesh, delay_s=0.25)
        compiled = build_programs(mesh, "devices", args, transport)[name].lower(x, w).compile()
        jax.block_until_ready(compiled(x, w))
        assert len({key for key, _ in transport.sent}) == args.chunks
        overlapped[name] = transport.overlapped_starts()
    assert set(overlapped["chained"].values()) == {0}
    assert len(overlapped["independent"]) == 8 and min(overlapped["independent"].values()) >= 1


def test_operands_past_100_kib_exchange_between_the_devices_of_one_process():
    # XLA:CPU copies a device operand of 100 KiB or more on its thread pool; with several
    # devices in a process, io_callback's copy of one could hang the callback for good.
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    spec = PartitionSpec(("data", "expert"))
    x = jax.random.normal(jax.random.key(1), (8 * 64, 512))  # 128 KiB per device
    x = jax.device_put(x, NamedSharding(mesh, spec))
    op = SocketAllToAll(SocketTransport(mesh, connections={}), "expert")
    expected = _run(mesh, spec, lambda b: jax.lax.all_to_all(b, "expert", 0, 1, tiled=True), x)
    for _ in range(3):
        ours = _run(
            mesh, spec, lambda b: all_to_all_now(op, b, key=4, split_axis=0, concat_axis=1), x
        )
        chex.assert_trees_all_equal(ours, expected)


def test_a_done_gives_up_after_its_bound_with_one_line():
    mesh = jax.make_mesh((8,), ("x",))
    spec = PartitionSpec("x")
    x = jax.device_put(jnp.ones((8 * 8, 4)), NamedSharding(mesh, spec))
    op = SocketAllToAll(SocketTransport(mesh, connections={}, wait_s=0.5), "x")

    def never_started(block):  # a done whose pieces no start sends
        return op.done(block[0, 0], block, key=5, like=block, split_axis=0, concat_axis=0)

    mapped = jax.shard_map(never_started, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    compiled = jax.jit(mapped).lower(x).compile()
    started = time.monotonic()
    with pytest.raises(Exception, match=r"socket all_to_all 5 at mesh position \d: the piece from"):
        jax.block_until_ready(compiled(x))
    assert time.monotonic() - started < 10
    # A new transport works (and its run replaces the failed one's token, which JAX keeps).
    op = SocketAllToAll(SocketTransport(mesh, connections={}), "x")
    _run(mesh, spec, lambda b: all_to_all_now(op, b, key=5, split_axis=0, concat_axis=0), x)


_WORKER_START = """
import os, signal, sys, time
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from experiments.emulation.socket_transport import (
    SocketAllToAll, SocketTransport, all_to_all_now, consume_token)

def run(mesh, spec, body, x):
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    return [np.asarray(s.data) for s in jax.jit(f)(x).addressable_shards]

def operand(mesh, spec, rows, columns, seed):  # 128 KiB per device with rows x 256
    values = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    values[0, 0] = -0.0
    return jax.make_array_from_callback(
        (rows, columns), NamedSharding(mesh, spec), lambda index: values[index])
"""

EQUALS_WORKER = _WORKER_START + textwrap.dedent(
    """
    # Four devices in a row: each exchange moves two pieces in memory and two over TCP;
    # two exchanges in flight at once, with computation between start and done.
    flat = jax.make_mesh((4,), ("x",))
    spec = PartitionSpec("x")
    x = operand(flat, spec, 4 * 128, 256, 0)
    transport = SocketTransport.connect(flat, "127.0.0.1")
    op = SocketAllToAll(transport, "x")

    def pipelined(b):
        first = op.start(b, key=1, split_axis=0)
        second = op.start(jnp.tanh(consume_token(b, first)), key=2, split_axis=1)
        a = op.done(first, second, key=1, like=b, split_axis=0, concat_axis=1)
        c = op.done(second, a[0, 0], key=2, like=b, split_axis=1, concat_axis=0)
        return jnp.concatenate([a.reshape(b.shape), c.reshape(b.shape)])

    def reference(b):
        a = jax.lax.all_to_all(b, "x", 0, 1, tiled=True)
        c = jax.lax.all_to_all(jnp.tanh(b), "x", 1, 0, tiled=True)
        return jnp.concatenate([a.reshape(b.shape), c.reshape(b.shape)])

    results = {"flat": (run(flat, spec, pipelined, x), run(flat, spec, reference, x))}
    # Hosts x local devices: one exchange over TCP, one in memory, at the same time.
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("host", "local"))
    spec = PartitionSpec(("host", "local"))
    x = operand(grid, spec, 4 * 128, 256, 1)
    transport.close()
    transport = SocketTransport.connect(grid, "127.0.0.1")
    across, within = SocketAllToAll(transport, "host"), SocketAllToAll(transport, "local")

    def both(b):
        t1 = across.start(b, key=3, split_axis=0)
        t2 = within.start(b, key=4, split_axis=1)
        a = across.done(t1, t2, key=3, like=b, split_axis=0, concat_axis=0)
        c = within.done(t2, a[0, 0], key=4, like=b, split_axis=1, concat_axis=1)
        return a + c

    def both_reference(b):
        a = jax.lax.all_to_all(b, "host", 0, 0, tiled=True)
        return a + jax.lax.all_to_all(b, "local", 1, 1, tiled=True)

    results["grid"] = (run(grid, spec, both, x), run(grid, spec, both_reference, x))
    for name, (ours, theirs) in results.items():
        same = all(
            a.tobytes() == b.tobytes() for a, b in zip(ours, theirs, strict=True))
        print(name, "same" if same else "different", flush=True)
    transport.close()
    """
)


def _start_two(script: str) -> list[subprocess.Popen]:
    """The two processes of a run with 2 devices each, on this machine."""
    from jaxmoe.cli.launch import child_environment, free_port

    environment = child_environment()
    environment["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    environment["PYTHONPATH"] = str(REPO_ROOT)
    coordinator = f"127.0.0.1:{free_port('127.0.0.1')}"
    return [
        subprocess.Popen(
            [sys.executable, "-c", script, coordinator, str(index)],
            env=environment,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]


def test_two_processes_of_two_devices_equal_the_gloo_all_to_all_bit_for_bit():
    processes = _start_two(EQUALS_WORKER)
    outputs = [process.communicate(timeout=120) for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-2000:]
        assert stdout.splitlines()[-2:] == ["flat same", "grid same"], stdout


DEATH_WORKER = _WORKER_START + textwrap.dedent(
    """
    # As experiments/overlap_control.py: SIGTERM ends the process, not JAX's preemption notice.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    mesh = jax.make_mesh((4,), ("x",))
    spec = PartitionSpec("x")
    x = operand(mesh, spec, 4 * 128, 256, 0)
    op = SocketAllToAll(SocketTransport.connect(mesh, "127.0.0.1", wait_s=300), "x")
    # Each process waits for pieces the other never sends (different keys): both block.
    key = 10 + jax.process_index()
    step = jax.jit(jax.shard_map(
        lambda b: all_to_all_now(op, b, key=key, split_axis=0, concat_axis=0),
        mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)).lower(x).compile()
    print("waiting", flush=True)
    try:
        jax.block_until_ready(step(x))
    except Exception as error:
        line = next(l for l in str(error).splitlines() if "socket all_to_all" in l)
        print(f"raised at {time.time():.3f}: {line}", flush=True)
        os._exit(0)
    """
)


def test_a_worker_blocked_in_a_done_ends_on_sigterm_and_its_peer_raises_at_once():
    processes = _start_two(DEATH_WORKER)
    guard = threading.Timer(120, lambda: [process.kill() for process in processes])
    guard.start()
    try:
        for process in processes:  # gloo's lines come first
            assert "waiting\n" in iter(process.stdout.readline, ""), "a worker ended early"
        time.sleep(1.0)  # both now wait in a done (the other never starts that key)
        killed_at = time.time()
        processes[1].send_signal(signal.SIGTERM)
        assert processes[1].wait(timeout=10) == -signal.SIGTERM
        stdout, stderr = processes[0].communicate(timeout=30)
    finally:
        guard.cancel()
        for process in processes:
            process.kill()
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("raised at "), stderr[-2000:]
    raised_at = float(line.split()[2].rstrip(":"))
    assert raised_at - killed_at < 10, line
    assert "process 1" in line and "socket all_to_all 10" in line, line


def _body_on_sockets(policy_name: str):
    """The per-device program that ``policy_name`` emits for a toy step with socket
    all-to-alls: an exchange, then a matmul that needs nothing from it."""
    from scheduling.policy import SchedulePolicy
    from scheduling.program.capture import capture
    from scheduling.runtime.emit import per_device_function
    from scheduling.runtime.transports import XlaAsync
    from scheduling.search.schedule import schedule

    mesh = jax.make_mesh((8,), ("x",))
    specs = (PartitionSpec("x"), PartitionSpec())
    x = jax.ShapeDtypeStruct((8 * 16, 32), jnp.float32, sharding=NamedSharding(mesh, specs[0]))
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32, sharding=NamedSharding(mesh, specs[1]))

    def step(x, w):
        exchanged = jax.lax.all_to_all(x @ w, "x", 0, 0, tiled=True)
        independent = x @ w.T
        return exchanged + independent

    program = capture(step, x, w, mesh=mesh, in_specs=specs, out_specs=specs[0])
    scheduled = schedule(program, SchedulePolicy(name=policy_name))
    connection = SocketTransport(mesh, {})
    carrier = lambda: SocketAllToAlls(connection, XlaAsync())
    run = per_device_function(scheduled.graph, scheduled.order, carrier)
    mapped = jax.shard_map(
        run, mesh=mesh, in_specs=program.in_specs, out_specs=program.out_specs, check_vma=False
    )
    (outer,) = jax.make_jaxpr(mapped)(x, w).eqns
    return outer.params["jaxpr"]


def _last_matmul_waits_for_the_done(body) -> bool:
    """Whether the last matmul depends, through data, on an output of the last done."""
    callbacks = [e for e in body.eqns if e.primitive.name in HOST_CALLBACK_NAMES]
    done = callbacks[-1]
    after_done: set = set()
    waits = False
    for eqn in body.eqns[body.eqns.index(done) :]:
        if eqn is done or any(v in after_done for v in eqn.invars if not hasattr(v, "val")):
            after_done.update(eqn.outvars)
        if eqn.primitive.name == "dot_general":
            waits = any(v in after_done for v in eqn.invars if not hasattr(v, "val"))
    return waits


def test_none_on_sockets_runs_no_matmul_during_the_transfer():
    # "none": start and done back to back, and the independent matmul waits for the done;
    # "async": the same matmul is scheduled inside the window, free to run during the transfer.
    assert _last_matmul_waits_for_the_done(_body_on_sockets("none"))
    assert not _last_matmul_waits_for_the_done(_body_on_sockets("async"))


def test_the_callbacks_are_named_in_the_compiled_module_as_traced_costs_reads_them():
    # scheduling.traced_costs tells a start's host work from a done's by these scopes.
    from experiments.emulation.socket_transport import DONE_SCOPE, START_SCOPE
    from scheduling.reports.measured_trace import hlo_op_keys

    mesh = jax.make_mesh((8,), ("x",))
    spec = PartitionSpec("x")
    op = SocketAllToAll(SocketTransport(mesh, connections={}), "x")

    def body(block):
        with jax.named_scope("moe"):
            token = op.start(block, key=1, split_axis=0)
            return op.done(token, block, key=1, like=block, split_axis=0, concat_axis=0)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    x = jax.ShapeDtypeStruct((64, 3), jnp.float32, sharding=NamedSharding(mesh, spec))
    keys = hlo_op_keys(jax.jit(mapped).lower(x).compile().as_text())
    owned = {key for info in keys.values() for key in info.own}
    for scope in (START_SCOPE, DONE_SCOPE):
        assert any(stack == f"moe/{scope}" and p in HOST_CALLBACK_NAMES for stack, p in owned)
