"""The socket all-to-all: bit for bit the all-to-all, and a start that returns before the
transfer so that computation placed before the done runs during it."""

from __future__ import annotations

import argparse
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

from scheduling.runtime.socket_all_to_all import (
    SocketAllToAll,
    SocketTransport,
    all_to_all_now,
    consume_token,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


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
    """In one process, each piece arrives ``delay_s`` after its start (a stand-in link on
    which transfers take time but no core)."""

    def __init__(self, mesh, delay_s: float):
        super().__init__(mesh, connections={})
        self.delay_s = delay_s

    def send(self, key, source, destination, piece):
        payload = np.ascontiguousarray(piece).tobytes()
        deliver = self.mailbox.put
        threading.Timer(self.delay_s, deliver, ((key, source, destination), payload)).start()


def test_the_pipelined_chunks_overlap_their_transfers_and_chained_ones_do_not():
    from experiments.overlap_control import build_programs

    mesh = jax.make_mesh((8,), ("devices",))
    args = argparse.Namespace(rows=64, width=32, layers=1, chunks=4)
    delay_s = 0.15
    programs = build_programs(mesh, "devices", args, _DelayedTransport(mesh, delay_s))
    x = jax.device_put(
        jnp.ones((64 * 8, 32), jnp.float32), NamedSharding(mesh, PartitionSpec("devices"))
    )
    w = jnp.eye(32, dtype=jnp.float32)
    seconds = {}
    for name in ("independent", "chained"):
        compiled = programs[name].lower(x, w).compile()
        jax.block_until_ready(compiled(x, w))
        started = time.perf_counter()
        jax.block_until_ready(compiled(x, w))
        seconds[name] = time.perf_counter() - started
    # Chained: four transfers one after another. Independent: two in flight at a time
    # (done i waits for start i+1), while the chunks compute, so about half the time; if
    # XLA moved each done next to its start, it would take as long as chained.
    assert seconds["chained"] >= 4 * delay_s
    assert seconds["independent"] < 3 * delay_s, seconds


WORKER = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from scheduling.runtime.socket_all_to_all import SocketAllToAll, SocketTransport, all_to_all_now

    mesh = jax.make_mesh((4,), ("x",))
    spec = PartitionSpec("x")
    x = jax.make_array_from_callback(
        (16, 8), NamedSharding(mesh, spec),
        lambda index: np.arange(128, dtype=np.float32).reshape(16, 8)[index] * 1.5 - 7)
    op = SocketAllToAll(SocketTransport.connect(mesh, "127.0.0.1"), "x")
    def run(body):
        f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        out = jax.jit(f)(x)
        return [np.asarray(s.data) for s in out.addressable_shards]
    ours = run(lambda b: all_to_all_now(op, b, key=3, split_axis=1, concat_axis=0))
    theirs = run(lambda b: jax.lax.all_to_all(b, "x", 1, 0, tiled=True))
    same = all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    print("same" if same else "different", flush=True)
    op.transport.close()
    """
)


def test_across_two_processes_it_equals_the_gloo_all_to_all(tmp_path):
    from jaxmoe.cli.launch import child_environment, free_port

    environment = child_environment()
    environment["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    environment["PYTHONPATH"] = str(REPO_ROOT)
    coordinator = f"127.0.0.1:{free_port('127.0.0.1')}"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, coordinator, str(index)],
            env=environment,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-2000:]
        assert stdout.strip().splitlines()[-1] == "same", stdout


def _body_on_sockets(policy_name: str):
    """The per-device program that ``policy_name`` emits for a toy step with socket
    all-to-alls: an exchange, then a matmul that needs nothing from it."""
    from scheduling.planning.plan import plan
    from scheduling.planning.policy import SchedulePolicy
    from scheduling.program.capture import capture
    from scheduling.runtime.emit import per_device_function
    from scheduling.runtime.transports import SocketAllToAlls, XlaAsync

    mesh = jax.make_mesh((8,), ("x",))
    specs = (PartitionSpec("x"), PartitionSpec())
    x = jax.ShapeDtypeStruct((8 * 16, 32), jnp.float32, sharding=NamedSharding(mesh, specs[0]))
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32, sharding=NamedSharding(mesh, specs[1]))

    def step(x, w):
        exchanged = jax.lax.all_to_all(x @ w, "x", 0, 0, tiled=True)
        independent = x @ w.T
        return exchanged + independent

    program = capture(step, x, w, mesh=mesh, in_specs=specs, out_specs=specs[0])
    planned = plan(program, SchedulePolicy(name=policy_name, transport="socket"))
    connection = SocketTransport(mesh, {})
    carrier = lambda: SocketAllToAlls(connection, XlaAsync())
    run = per_device_function(planned.graph, planned.schedule, carrier)
    mapped = jax.shard_map(
        run, mesh=mesh, in_specs=program.in_specs, out_specs=program.out_specs, check_vma=False
    )
    (outer,) = jax.make_jaxpr(mapped)(x, w).eqns
    return outer.params["jaxpr"]


def _last_matmul_waits_for_the_done(body) -> bool:
    """Whether the last matmul depends, through data, on an output of the last done."""
    callbacks = [e for e in body.eqns if e.primitive.name == "io_callback"]
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
    # "async": the same matmul is planned inside the window, free to run during the transfer.
    assert _last_matmul_waits_for_the_done(_body_on_sockets("none"))
    assert not _last_matmul_waits_for_the_done(_body_on_sockets("async"))
