"""The ragged dropless dispatch: its exchange against ``ragged_all_to_all``'s semantics, and
the layer against the padded dropless layer.

XLA:CPU cannot run ``jax.lax.ragged_all_to_all``, so the exchange that runs here (the
static emulation) is checked against the operation's documented semantics written out in
NumPy, forward and transposed; the native operation is only compiled. The layer must
compute what the padded dropless layer computes (outputs and every gradient, up to the
order of float32 sums), drop nothing, and with a small receive buffer drop exactly the
rows past it.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxmoe.config import ConfigError, MoEConfig, ParallelConfig
from jaxmoe.experimental import ExperimentalOptions
from jaxmoe.layers.ragged import (
    emulated_ragged_all_to_all,
    ragged_all_to_all,
    receive_bound,
)
from jaxmoe.parallel.mesh import build_mesh
from tests.layers.test_dispatchers import forward_and_gradients
from tests.layers.test_moe import BATCH, SEQ, Case, inputs, make_layer

GROUP, SLICES_PER_PEER, ROWS, WIDTH, OUT_ROWS = 8, 2, 48, 3, 48


def _exchange_arguments(seed: int):
    """Per device: an operand, its slices (random sizes, gaps between them) for every peer,
    and where each lands on its receiver (disjoint, gaps between them)."""
    rng = np.random.default_rng(seed)
    k = GROUP * SLICES_PER_PEER
    sizes = rng.integers(0, 3, (GROUP, k))  # [sender, slice]
    input_offsets = np.zeros((GROUP, k), np.int32)
    for sender in range(GROUP):
        gaps = rng.integers(0, 2, k)
        input_offsets[sender] = np.cumsum(gaps + sizes[sender]) - sizes[sender]
    assert (input_offsets + sizes).max() <= ROWS
    # recv_sizes on receiver r: slice s * n + j of sender s to r: sizes[s, r * n + j].
    recv = sizes.reshape(GROUP, GROUP, SLICES_PER_PEER).transpose(1, 0, 2).reshape(GROUP, k)
    output_offsets = np.zeros((GROUP, k), np.int32)  # [sender, slice]: on the receiver
    for receiver in range(GROUP):
        order = rng.permutation(k)  # slices land in a shuffled order, with gaps
        at = 0
        for index in order:
            sender, j = divmod(int(index), SLICES_PER_PEER)
            output_offsets[sender, receiver * SLICES_PER_PEER + j] = at
            at += recv[receiver, index] + rng.integers(0, 2)
        assert at <= OUT_ROWS
    operand = rng.normal(size=(GROUP, ROWS, WIDTH)).astype(np.float32)
    output = rng.normal(size=(GROUP, OUT_ROWS, WIDTH)).astype(np.float32)
    to_int = functools.partial(np.asarray, dtype=np.int32)
    return operand, output, to_int(input_offsets), to_int(sizes), output_offsets, to_int(recv)


def _reference(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The semantics in ``jax.lax.ragged_all_to_all``'s documentation, device by device."""
    result = output.copy()
    n = SLICES_PER_PEER
    for sender in range(GROUP):
        for i in range(GROUP * n):
            receiver, size = i // n, send_sizes[sender, i]
            assert size == recv_sizes[receiver, sender * n + i % n]
            start, at = input_offsets[sender, i], output_offsets[sender, i]
            result[receiver, at : at + size] = operand[sender, start : start + size]
    return result


def _mapped(function, *args):
    mesh = jax.make_mesh((GROUP,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = PartitionSpec("x")
    mapped = jax.shard_map(
        lambda *a: function(*(x[0] for x in a))[None],
        mesh=mesh,
        in_specs=(spec,) * len(args),
        out_specs=spec,
    )
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, jax.NamedSharding(mesh, spec)) for a in args]
        return np.asarray(jax.jit(mapped)(*args))


def _emulated(known_offsets: bool):
    def exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        received = None
        if known_offsets:  # the receiver's own copy of where its slices land
            received = jax.lax.all_to_all(output_offsets.reshape(GROUP, -1), "x", 0, 0).reshape(-1)
        return emulated_ragged_all_to_all(
            operand,
            output,
            input_offsets,
            send_sizes,
            output_offsets,
            recv_sizes,
            axis_name="x",
            max_rows_per_peer=2 * SLICES_PER_PEER,
            received_output_offsets=received,
        )

    return exchange


@pytest.mark.parametrize("known_offsets", [False, True])
def test_emulated_exchange_has_the_semantics_of_ragged_all_to_all(known_offsets):
    for seed in range(3):
        args = _exchange_arguments(seed)
        np.testing.assert_array_equal(_mapped(_emulated(known_offsets), *args), _reference(*args))


def test_emulated_exchange_transposes_to_the_exchange_back():
    """The operand's gradient of ``sum(result * c)`` is ``c`` read back from where each
    row landed (zero for rows not sent); the output's, ``c`` where nothing landed."""
    operand, output, input_offsets, sizes, output_offsets, recv = _exchange_arguments(7)
    cotangent = np.random.default_rng(8).normal(size=output.shape).astype(np.float32)

    def gradients(operand, output, input_offsets, sizes, output_offsets, recv, cotangent):
        def loss(operand, output):
            exchange = _emulated(False)
            result = exchange(operand, output, input_offsets, sizes, output_offsets, recv)
            return jnp.sum(result * cotangent)

        return jnp.concatenate(jax.grad(loss, argnums=(0, 1))(operand, output))

    got = _mapped(gradients, operand, output, input_offsets, sizes, output_offsets, recv, cotangent)
    want_operand, want_output = np.zeros_like(operand), cotangent.copy()
    n = SLICES_PER_PEER
    for sender in range(GROUP):
        for i in range(GROUP * n):
            receiver, size = i // n, sizes[sender, i]
            start, at = input_offsets[sender, i], output_offsets[sender, i]
            want_operand[sender, start : start + size] = cotangent[receiver, at : at + size]
            want_output[receiver, at : at + size] = 0
    np.testing.assert_array_equal(got, np.concatenate([want_operand, want_output], axis=1))


def test_the_native_exchange_lowers_to_ragged_all_to_all_which_xla_cpu_refuses():
    """Where XLA runs it (not XLA:CPU) the exchange is ``ragged_all_to_all``. XLA:CPU
    refuses it when it builds the executable; should that change, the exchange could be
    native on CPU too (``jaxmoe.layers.ragged.native_exchange_runs``)."""
    args = _exchange_arguments(0)

    def native(operand, output, input_offsets, sizes, output_offsets, recv):
        return ragged_all_to_all(
            operand,
            output,
            input_offsets,
            sizes,
            output_offsets,
            recv,
            axis_name="x",
            max_rows_per_peer=4,
            native=True,
        )

    mesh = jax.make_mesh((GROUP,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = PartitionSpec("x")
    mapped = jax.shard_map(
        lambda *a: native(*(x[0] for x in a))[None], mesh=mesh, in_specs=(spec,) * 6, out_specs=spec
    )
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, jax.NamedSharding(mesh, spec)) for a in args]
        lowered = jax.jit(mapped).lower(*placed)
        assert "ragged_all_to_all" in lowered.as_text()
        with pytest.raises(jax.errors.JaxRuntimeError, match="ragged-all-to-all"):
            lowered.compile()


def test_receive_bound_is_the_worst_case_or_the_factor_of_even_routing():
    # 8 devices, 32 tokens each, top-2, 4 slots per device: at most 8 * 32 * 2 rows.
    assert receive_bound(32, 2, 8, 4, None) == 512
    assert receive_bound(32, 2, 8, 4, 1.5) == 96  # 1.5 x the 64 rows of even routing
    assert receive_bound(32, 2, 8, 1, None) == 256  # one slot: one row per token
    assert receive_bound(32, 2, 8, 1, 100.0) == 256  # never past the worst case


def test_ragged_is_a_dropless_choice_of_the_all_to_all_dispatcher():
    with pytest.raises(ConfigError, match="capacity_factor none"):
        MoEConfig(capacity_factor=1.0, dropless_dispatch="ragged")
    with pytest.raises(ConfigError, match="dispatcher all_to_all"):
        MoEConfig(capacity_factor=None, dropless_dispatch="ragged", dispatcher="all_gather")
    with pytest.raises(ConfigError, match="dropless_dispatch ragged"):
        MoEConfig(capacity_factor=None, ragged_buffer_factor=2.0)


# --- The layer ------------------------------------------------------------------------------

DROPLESS = {
    "top1": Case("top1-dropless", top_k=1, capacity_factor=None),
    "top2": Case("top2-dropless", top_k=2, capacity_factor=None),
}
LAYOUTS = {
    "one-device": None,
    "expert8": ParallelConfig(1, 8),
    "data2-expert4": ParallelConfig(2, 4),
}


@functools.cache
def _layer_result(case: Case, layout: str, dispatch: str, factor: float | None = None):
    _, x, cotangent = inputs(case)
    layer = make_layer(case)
    layer.config = dataclasses.replace(
        case.moe_config, dropless_dispatch=dispatch, ragged_buffer_factor=factor
    )
    parallel = LAYOUTS[layout]
    mesh = None if parallel is None else build_mesh(parallel)
    return forward_and_gradients(layer, x, cotangent, mesh)


@pytest.mark.parametrize(
    ("top", "layout"), [("top2", "one-device"), ("top1", "expert8"), ("top2", "data2-expert4")]
)
def test_ragged_layer_computes_what_the_padded_layer_computes(top, layout):
    case = DROPLESS[top]
    (y, stats, grads, grad_x), (y_padded, stats_padded, grads_padded, grad_x_padded) = (
        _layer_result(case, layout, "ragged"),
        _layer_result(case, layout, "padded"),
    )
    np.testing.assert_allclose(y, y_padded, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_x, grad_x_padded, rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), grads, grads_padded
    )
    assert int(stats.dropped) == 0
    np.testing.assert_array_equal(stats.tokens_per_expert, stats_padded.tokens_per_expert)
    np.testing.assert_allclose(stats.aux_loss, stats_padded.aux_loss, rtol=1e-6)


def test_rows_past_a_small_buffer_drop_and_are_counted():
    """One expert per device: a device receives its expert's rows, and with a buffer of
    ``factor x tokens x top_k`` rows it keeps that many; the rest drop, counted, and the
    kept ones compute what they compute in the padded layer."""
    case = DROPLESS["top1"]
    factor = 1.0
    y, stats, _, _ = _layer_result(case, "expert8", "ragged", factor)
    per_device_tokens = BATCH * SEQ // 8
    bound = receive_bound(per_device_tokens, case.top_k, 8, 1, factor)
    load = np.asarray(stats.tokens_per_expert)  # rows each device receives
    assert load.max() > bound, "the routing must overflow the small buffer somewhere"
    assert int(stats.dropped) == int(np.maximum(load - bound, 0).sum())
    assert int(stats.assignments) == BATCH * SEQ * case.top_k
    y_padded = _layer_result(case, "expert8", "padded")[0]
    # Tokens all of whose rows were kept are unchanged.
    changed = np.any(np.abs(y - y_padded) > 1e-5, axis=-1)
    assert 0 < changed.sum() <= int(stats.dropped)


def test_the_replica_split_is_a_choice_of_the_ragged_dispatch():
    with pytest.raises(ConfigError, match="replica_split"):
        ExperimentalOptions(replica_split="evenly")
    round_robin = ExperimentalOptions(replica_split="round_robin")
    with pytest.raises(ConfigError, match="dropless_dispatch ragged"):
        round_robin.check(MoEConfig())
    round_robin.check(MoEConfig(capacity_factor=None, dropless_dispatch="ragged"))
