"""Scheduled train steps with socket all-to-alls compute exactly what the plain step does.

In one process the socket transport hands every piece over in memory, so this checks the
emitted program (start/done as host callbacks, the order pinned by data dependence)
rather than the network (tests/scheduling/test_socket_all_to_all.py).
"""

from __future__ import annotations

import functools
import importlib

import chex
import pytest

import scheduling
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.data.batches import BatchSampler, load_splits, put_on_mesh
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import scheduled_train_step
from jaxmoe.train.state import init_train_state

SMALL = [
    *("--model.num_layers", "2", "--model.seq_len", "16", "--train.batch_size", "8"),
    *("--model.d_model", "32", "--model.d_ff", "64", "--model.num_heads", "2"),
    *("--data.max_bytes", "200000"),
]


def _steps(step, config, mesh, count=3):
    sampler = BatchSampler(
        load_splits(config).train, config.model.seq_len, config.train.batch_size, 0
    )
    state = init_train_state(resolve(config, mesh))
    for index in range(count):
        state, metrics = step(state, put_on_mesh(sampler, index, mesh))
    return state, metrics


@functools.cache
def _plain():
    config = config_from_train_args(SMALL)
    mesh = build_mesh(config.parallel)
    return _steps(scheduled_train_step(resolve(config, mesh)).compile(), config, mesh)


@pytest.mark.parametrize(
    "schedule", ["none", "dw", pytest.param("partition", marks=pytest.mark.slow)]
)
def test_socket_all_to_alls_keep_the_step_bit_for_bit(schedule, monkeypatch):
    transports = importlib.import_module("scheduling.runtime.transports")
    # One process: force the transport that would be used across processes.
    monkeypatch.setattr(transports, "socket_applies", lambda: True)
    monkeypatch.setattr(
        transports.SocketTransport, "connect", classmethod(lambda cls, mesh, **_: cls(mesh, {}))
    )
    flags = ["--schedule", schedule, "--schedule.transport", "socket"]
    config = config_from_train_args([*SMALL, *flags])
    mesh = build_mesh(config.parallel)
    planned = scheduled_train_step(resolve(config, mesh))
    assert "io_callback" in planned.stablehlo() or "callback" in planned.stablehlo()
    chex.assert_trees_all_equal(_steps(planned.compile(), config, mesh), _plain())


def test_the_socket_transport_is_used_only_across_processes_on_cpu():
    # One process: the socket transport falls back to XLA's collectives.
    assert not scheduling.socket_applies()
    mesh = build_mesh(config_from_train_args(SMALL).parallel)
    socket = scheduling.connect_transport("socket", mesh)
    assert socket is scheduling.connect_transport("xla", mesh)
