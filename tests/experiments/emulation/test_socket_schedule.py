"""Scheduled train steps with the emulated cluster's socket all-to-alls (a research option)
compute exactly what the plain step does.

In one process the socket transport hands every piece over in memory, so this checks the
emitted program (start/done as host callbacks, the order pinned by data dependence)
rather than the network (tests/experiments/emulation/test_socket_transport.py).
"""

from __future__ import annotations

import functools

import chex
import pytest

import scheduling
from experiments.emulation import socket_transport
from experiments.emulation.socket_transport import over_sockets
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.data.batches import put_on_mesh
from jaxmoe.data.mixture import load_mixture, run_batches
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import scheduled_train_step
from jaxmoe.train.state import init_train_state
from tests.train.runs import default_corpus_head, with_schedule
from tests.train.test_ragged_dropless import CASES, STEPS, family, reference, run

SMALL = [
    *("--model.num_layers", "2", "--model.seq_len", "16", "--train.batch_size", "8"),
    *("--model.d_model", "32", "--model.d_ff", "64", "--model.num_heads", "2"),
    *default_corpus_head(200_000),
]


def _steps(step, config, mesh, count=3):
    sampler = run_batches(config, load_mixture(config))[0]
    state = init_train_state(resolve(config, mesh))
    for index in range(count):
        state, metrics = step(state, put_on_mesh(sampler, index, mesh))
    return state, metrics


@functools.cache
def _plain():
    config = config_from_train_args(SMALL)
    mesh = build_mesh(config.parallel)
    return _steps(scheduled_train_step(resolve(config, mesh)).compile(), config, mesh)


@pytest.fixture
def one_process_sockets(monkeypatch):
    """One process: force the transport that would be used across processes."""
    monkeypatch.setattr(socket_transport, "socket_applies", lambda: True)
    monkeypatch.setattr(
        socket_transport.SocketTransport,
        "connect",
        classmethod(lambda cls, mesh, **_: cls(mesh, {})),
    )


# The synchronous order (none) over sockets is bit for bit by default in the test of the
# routed rows below; here the reordered step.
@pytest.mark.parametrize(
    "schedule",
    [pytest.param("none", marks=pytest.mark.slow), "dw",
     pytest.param("partition", marks=pytest.mark.slow)],
)  # fmt: skip
def test_socket_all_to_alls_keep_the_step_bit_for_bit(schedule, one_process_sockets):
    config = config_from_train_args([*SMALL, "--schedule", schedule])
    mesh = build_mesh(config.parallel)
    planned = scheduled_train_step(resolve(config, mesh), over_sockets())
    assert "io_callback" in planned.stablehlo() or "callback" in planned.stablehlo()
    chex.assert_trees_all_equal(_steps(planned.compile(), config, mesh), _plain())


def test_the_socket_transport_is_used_only_across_processes_on_cpu():
    # One process: the socket transport falls back to XLA's collectives.
    assert not socket_transport.socket_applies()
    mesh = build_mesh(config_from_train_args(SMALL).parallel)
    socket = socket_transport.socket_all_to_alls()(mesh)
    assert socket is scheduling.connect_transport("xla", mesh)


def test_the_socket_transport_sends_only_the_routed_rows(one_process_sockets):
    """In one process the socket transport hands its pieces over in memory: the step is bit
    for bit the plain one, and the bytes of the ragged pieces are exactly the routed rows
    (each assignment's row once per exchange: out and back, forward and backward)."""
    key = CASES["mixtral-replicas"]
    config = family(key[0], "ragged", *key[1:])
    traffic = socket_transport.SocketTransport.traffic
    before = dict(traffic)
    got = run(with_schedule(config, "none"), experimental=over_sockets())
    sent = traffic["local"] - before.get("local", 0)
    whole = traffic["local_whole"] - before.get("local_whole", 0)
    chex.assert_trees_all_equal(got, reference(key[0], "ragged", *key[1:]))
    tokens = config.train.batch_size * config.model.seq_len
    moe_layers = config.model.num_layers
    rows = STEPS * moe_layers * 4 * tokens * config.moe.top_k
    assert sent == rows * config.model.d_model * 4
    assert whole > 2 * sent
