"""Dropless training with the ragged dispatch: the padded dispatch's losses, nothing
dropped, every schedule exact, and the scheduler's view of its exchanges (priced by the
routed rows, left whole by COMET). Only the routed rows go over the emulated cluster's
socket transport: tests/experiments/emulation/test_socket_schedule.py.

The models are the Mixtral- and (slow) DeepSeek-like ``-tiny`` presets cut to two layers
of width 32 (sequence 16) on 2 x 4 devices, dropless.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import scheduling
from jaxmoe.config import Config, ParallelConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.presets import preset
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import capture_train_step, scheduled_train_step
from jaxmoe.train.state import init_train_state
from scheduling import ExperimentalOptions
from tests.train.batches import random_batch
from tests.train.runs import with_schedule

STEPS = 2
SCHEDULES = ("async", "dw", "partition", "lancet", "comet", "lancet+comet", "expert_pipeline")


@functools.cache
def family(name: str, dispatch: str, layout: str = "data2-expert4", slots: int | None = None):
    config = preset(name)
    model = dataclasses.replace(
        config.model,
        d_model=32,
        num_layers=2,
        seq_len=16,
        head_dim=16 if config.model.head_dim else None,
        d_ff=64,
    )
    moe = dataclasses.replace(
        config.moe,
        capacity_factor=None,
        dropless_dispatch=dispatch,
        d_expert=16 if config.moe.d_expert else None,
        d_shared_expert=32 if config.moe.d_shared_expert else None,
        slots_per_device=slots,
    )
    parallel = {
        "data2-expert4": ParallelConfig(data=2, expert=4),
        "data2-expert4-tensor2": ParallelConfig(data=2, expert=4, tensor=2),
    }[layout]
    train = dataclasses.replace(config.train, batch_size=16, warmup_steps=1)
    return dataclasses.replace(config, model=model, moe=moe, train=train, parallel=parallel)


def run(config: Config, steps: int = STEPS, experimental=None):
    """Metrics of every step and the final parameters (``experimental``: research options)."""
    mesh = build_mesh(config.parallel)
    step = scheduled_train_step(resolve(config, mesh), experimental).compile()
    state = init_train_state(resolve(config, mesh))
    rng = np.random.default_rng(1)
    history = []
    for _ in range(steps):
        state, metrics = step(state, random_batch(rng, config, mesh))
        history.append(jax.device_get(metrics))
    return history, jax.device_get(state.params)


@functools.cache
def reference(*key):
    return run(with_schedule(family(*key), "none"))


CASES = {
    "mixtral-replicas": ("mixtral-tiny", "data2-expert4", 3),
    "mixtral-sequence-parallel": ("mixtral-tiny", "data2-expert4-tensor2"),
    "deepseek": ("deepseek_v3-tiny",),
}


@pytest.mark.parametrize(
    # Sequence parallelism is another layout of the same exchange: slow. DeepSeek is another
    # family for the same dispatch (its shared experts and dense layer do not use it): slow.
    "case",
    [pytest.param(c, marks=pytest.mark.slow if c != "mixtral-replicas" else ()) for c in CASES],
)
def test_ragged_dropless_trains_as_the_padded_dispatch_and_drops_nothing(case):
    name, *rest = CASES[case]
    (ragged, ragged_params), (padded, padded_params) = (
        reference(name, "ragged", *rest),
        reference(name, "padded", *rest),
    )
    for key in ("loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in ragged], [m[key] for m in padded], rtol=1e-5, err_msg=key
        )
    # Adam divides by the gradient's magnitude, so where a gradient is near zero its
    # float32 rounding moves the update by up to the learning rate's order.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
        ragged_params,
        padded_params,
    )
    np.testing.assert_array_equal(
        [m["tokens_per_expert"] for m in ragged], [m["tokens_per_expert"] for m in padded]
    )
    assert all(m["dropped_fraction"] == 0 for m in ragged)
    if len(rest) > 1:  # replicas: every routed row lands on some copy (the split differs:
        # the ragged dispatch deals a device's rows round-robin, the padded a group's)
        for m in ragged:
            np.testing.assert_array_equal(
                np.sum(m["device_load"], axis=-1), np.sum(m["tokens_per_expert"], axis=-1)
            )


@pytest.mark.parametrize(
    "schedule",
    [
        # The composed schedules contain the slow ones' passes (lancet's packing splits the
        # collectives as dw and async do).
        pytest.param(
            s,
            marks=pytest.mark.slow if s in ("async", "dw", "partition", "comet", "lancet") else (),
        )
        for s in SCHEDULES
    ],
)
def test_every_schedule_is_exact_on_the_ragged_step(schedule):
    key = CASES["mixtral-replicas"]
    config = with_schedule(
        family(key[0], "ragged", *key[1:]),
        schedule,
        partition_chunks=2 if schedule in ("partition", "expert_pipeline") else None,
    )
    always = ExperimentalOptions(partition_always=schedule in ("partition", "lancet"))
    history, _ = run(config, experimental=always)
    expected, _ = reference(key[0], "ragged", *key[1:])
    for key_ in ("loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[key_] for m in history], [m[key_] for m in expected], rtol=1e-5, err_msg=key_
        )
    for key_ in ("dropped_fraction", "tokens_per_expert", "device_load"):
        np.testing.assert_array_equal([m[key_] for m in history], [m[key_] for m in expected])


@functools.cache
def _captured(name: str):
    config = family(name, "ragged")
    program, _ = capture_train_step(resolve(config, build_mesh(config.parallel)))
    return config, program


def test_the_cost_model_prices_ragged_exchanges_by_their_routed_rows():
    from scheduling.costs.cost_model import collective_wire_bytes, op_flops, ragged_rows

    config, program = _captured("mixtral-tiny")
    axis_sizes = dict(program.mesh.shape)
    tokens = config.train.batch_size * config.model.seq_len // config.parallel.num_devices
    routed = tokens * config.moe.top_k  # rows of each device under even routing
    exchanges = [op for op in program.ops if op.primitive == "all_to_all"]
    assert exchanges and all(ragged_rows(op) == routed for op in exchanges)
    group = config.parallel.expert
    row_bytes = config.model.d_model * 4
    for op in exchanges:
        static = op.inputs[0].aval.size * 4 * (group - 1) / group
        assert collective_wire_bytes(op, axis_sizes) == routed * row_bytes * (group - 1) / group
        assert collective_wire_bytes(op, axis_sizes) < static
    grouped = [op for op in program.ops if op.primitive == "ragged_dot_general"]
    assert grouped and all(ragged_rows(op) == routed for op in grouped)
    forward = grouped[0]  # the experts' first GEMM: [rows, d] x [slots, d, 2 hidden]
    hidden = forward.outputs[0].aval.shape[-1]
    assert op_flops(forward) == 2 * routed * config.model.d_model * hidden


def test_the_cost_model_prices_the_native_exchange_by_the_rows_it_moves():
    """``ragged_all_to_all`` (the GPU/TPU form, traced here): its sender's rows out, the
    returned rows back, however large the receive buffer."""
    from jaxmoe.layers.ragged import ragged_all_to_all
    from scheduling.costs.cost_model import CostModel, collective_wire_bytes
    from scheduling.profiles import PROFILES

    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("x")

    def step(rows, buffer, sizes):
        out = ragged_all_to_all(
            rows, buffer, sizes, sizes, sizes, sizes, axis_name="x", max_rows_per_peer=8,
            native=True,
        )  # fmt: skip
        back = ragged_all_to_all(
            out, rows, sizes, sizes, sizes, sizes, axis_name="x", max_rows_per_peer=8,
            native=True,
        )  # fmt: skip
        return back

    sharded = jax.sharding.NamedSharding(mesh, spec)
    shapes = [
        jax.ShapeDtypeStruct((4 * 10, 6), np.float32, sharding=sharded),
        jax.ShapeDtypeStruct((4 * 64, 6), np.float32, sharding=sharded),
        jax.ShapeDtypeStruct((4 * 4,), np.int32, sharding=sharded),
    ]
    program = scheduling.capture(step, *shapes, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    ops = [op for op in program.ops if op.primitive == "ragged_all_to_all"]
    assert len(ops) == 2
    for op in ops:  # 10 rows of 6 floats, 3/4 of them to the other devices
        assert collective_wire_bytes(op, {"x": 4}) == 10 * 6 * 4 * 3 / 4
    model = CostModel(PROFILES["a100"], {"x": 4})
    skewed = CostModel(PROFILES["a100"], {"x": 4}, ragged_load=2.0)
    assert 0 < model.seconds(ops[0]) < skewed.seconds(ops[0])


def test_comet_refuses_ragged_exchanges_in_one_line():
    from scheduling.passes.exchange_regions import (
        RAGGED_REFUSAL,
        all_decompositions,
        find_exchanges,
    )

    _, program = _captured("mixtral-tiny")
    exchanges = find_exchanges(program)
    assert exchanges and all(exchange.refused == RAGGED_REFUSAL for exchange in exchanges)
    assert all(regions == [] for regions in all_decompositions(program, (2, 4)).values())
    assert "\n" not in RAGGED_REFUSAL
