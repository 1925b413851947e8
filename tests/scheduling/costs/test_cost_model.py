"""The cost model: FLOPs, bytes and wire bytes per op, device profiles, multi-node links.
(The two-stream simulator: test_simulate.py.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from scheduling.costs import cost_model
from scheduling.costs.collective_groups import members_per_node
from scheduling.costs.cost_model import CostModel, collective_wire_bytes, op_bytes, op_flops
from scheduling.profiles import PROFILE_FILES, PROFILES, DeviceProfile, device_profile, load_profile
from scheduling.program.capture import capture
from tests.scheduling.toys import mesh_2x4, mesh_x, sds

M, K, N_COLS = 3, 5, 7
F32 = 4

PROFILE = DeviceProfile(
    "test",
    flops_per_s=1e9,
    memory_bytes_per_s=1e8,
    op_overhead_s=1e-6,
    link_bytes_per_s=1e6,
    link_latency_s=1e-5,
)


def _ops(step, *shapes, mesh=None, in_specs, out_specs):
    mesh = mesh or mesh_x()
    program = capture(step, *shapes, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return {op.primitive: op for op in program.ops}, program


# Cost.


def test_dot_general_flops_are_2mnk():
    mesh = mesh_x()
    ops, _ = _ops(
        lambda a, b: (a @ b).reshape(-1),
        sds(mesh, (M, K), P()),
        sds(mesh, (K, N_COLS), P()),
        in_specs=(P(), P()),
        out_specs=P(),
    )
    dot = ops["dot_general"]
    assert op_flops(dot) == 2 * M * N_COLS * K
    assert op_bytes(dot) == (M * K + K * N_COLS + M * N_COLS) * F32
    cost = CostModel(PROFILE, {"x": 8})
    expected = PROFILE.op_overhead_s + max(
        2 * M * N_COLS * K / PROFILE.flops_per_s, op_bytes(dot) / PROFILE.memory_bytes_per_s
    )
    assert cost.compute_seconds(dot) == pytest.approx(expected)
    assert cost.seconds(dot) == pytest.approx(expected)
    # A reshape is a view: no FLOPs, no bytes, no time (not even the per-op overhead).
    reshape = ops["reshape"]
    assert op_flops(reshape) == 0
    assert op_bytes(reshape) == 0
    assert cost.compute_seconds(reshape) == 0.0


def test_a_scan_is_priced_as_its_body_times_its_length():
    mesh = mesh_x()

    def step(a, b):
        def body(carry, _):
            return jnp.tanh(carry @ b), None

        out, _ = jax.lax.scan(body, a, None, length=4)
        return out.reshape(-1)

    ops, _ = _ops(
        step,
        sds(mesh, (M, K), P()),
        sds(mesh, (K, K), P()),
        in_specs=(P(), P()),
        out_specs=P(),
    )
    scan = ops["scan"]
    assert op_flops(scan) == 4 * (2 * M * K * K + 8 * M * K)  # the product and its tanh
    cost = CostModel(PROFILE, {"x": 8})
    one_trip = PROFILE.op_overhead_s * 2 + (2 * M * K * K + 8 * M * K) / PROFILE.flops_per_s
    assert cost.compute_seconds(scan) >= 4 * one_trip
    assert cost.compute_seconds(scan) == pytest.approx(
        4 * sum(cost.seconds(inner) for inner in cost_model.body_ops(scan)[0][1])
    )


def test_an_update_at_a_dynamic_offset_moves_the_update_alone():
    mesh = mesh_x()
    ops, _ = _ops(
        lambda big, small, i: jax.lax.dynamic_update_slice_in_dim(big, small, i[0], 0),
        sds(mesh, (64, K), P()),
        sds(mesh, (2, K), P()),
        sds(mesh, (1,), P(), jnp.int32),
        in_specs=(P(), P(), P()),
        out_specs=P(),
    )
    assert op_bytes(ops["dynamic_update_slice"]) == 2 * 2 * K * F32


def test_batched_dot_general_flops():
    mesh = mesh_x()
    ops, _ = _ops(
        lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b),
        sds(mesh, (2, M, K), P()),
        sds(mesh, (2, K, N_COLS), P()),
        in_specs=(P(), P()),
        out_specs=P(),
    )
    assert op_flops(ops["dot_general"]) == 2 * 2 * M * N_COLS * K


def test_elementwise_and_reduction_flops():
    mesh = mesh_x()
    ops, _ = _ops(
        lambda a: jnp.sum(jnp.exp(a) + a),
        sds(mesh, (M, K), P()),
        in_specs=P(),
        out_specs=P(),
    )
    assert op_flops(ops["add"]) == M * K
    assert op_flops(ops["exp"]) == 8 * M * K
    assert op_flops(ops["reduce_sum"]) == M * K


def _collective_step(x):
    return (
        jax.lax.all_to_all(x, "x", 0, 0, tiled=True),
        jax.lax.psum(x, "x"),
        jax.lax.all_gather(x, "x", tiled=True),
        jax.lax.ppermute(x, "x", [(i, (i + 1) % 8) for i in range(8)]),
    )


def test_collective_wire_bytes_over_eight_devices():
    mesh = mesh_x()
    ops, _ = _ops(
        _collective_step,
        sds(mesh, (64, 4), P("x")),
        in_specs=P("x"),
        out_specs=(P("x"), P("x"), P("x"), P("x")),
    )
    nbytes = 8 * 4 * F32  # per device
    sizes = {"x": 8}
    assert collective_wire_bytes(ops["all_to_all"], sizes) == pytest.approx(nbytes * 7 / 8)
    assert collective_wire_bytes(ops["psum"], sizes) == pytest.approx(2 * nbytes * 7 / 8)
    assert collective_wire_bytes(ops["all_gather"], sizes) == pytest.approx(8 * nbytes * 7 / 8)
    assert collective_wire_bytes(ops["ppermute"], sizes) == pytest.approx(nbytes)
    cost = CostModel(PROFILE, sizes)
    a2a = ops["all_to_all"]
    assert cost.seconds(a2a) == pytest.approx(
        PROFILE.link_latency_s + nbytes * 7 / 8 / PROFILE.link_bytes_per_s
    )
    assert cost.collective_seconds(a2a) == cost.seconds(a2a)


def test_collective_group_is_the_product_of_its_axes():
    mesh = mesh_2x4()

    def step(x):
        return (
            jax.lax.psum(x, ("data", "expert")),
            jax.lax.all_to_all(x, "expert", 0, 0, tiled=True),
        )

    ops, _ = _ops(step, sds(mesh, (8, 4), P()), mesh=mesh, in_specs=P(), out_specs=(P(), P()))
    nbytes = 8 * 4 * F32
    sizes = dict(mesh.shape)
    assert collective_wire_bytes(ops["psum"], sizes) == pytest.approx(2 * nbytes * 7 / 8)
    assert collective_wire_bytes(ops["all_to_all"], sizes) == pytest.approx(nbytes * 3 / 4)


def test_collective_over_a_group_of_one_costs_nothing():
    mesh = jax.make_mesh((1, 8), ("one", "x"))
    ops, _ = _ops(
        lambda x: jax.lax.psum(x, "one"),
        sds(mesh, (8, 4), P()),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
    )
    psum = ops["psum"]
    cost = CostModel(PROFILE, dict(mesh.shape))
    assert collective_wire_bytes(psum, dict(mesh.shape)) == 0.0
    assert cost.seconds(psum) == 0.0  # not even the link latency
    # The same op, costed for a larger group.
    assert collective_wire_bytes(psum, {"one": 4}) > 0


@pytest.mark.parametrize("field", ["flops_per_s", "memory_bytes_per_s", "link_bytes_per_s"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_device_profile_rejects_non_positive_throughputs(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(PROFILE, **{field: value})


def test_device_profile_with_link():
    slow = PROFILE.with_link(1e3)
    assert slow.link_bytes_per_s == 1e3
    assert slow.link_latency_s == PROFILE.link_latency_s
    assert PROFILE.with_link(1e3, 0.5).link_latency_s == 0.5
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        PROFILE.with_link(0.0)
    assert set(PROFILES) >= {"a100", "v100", "cpu"}


# Multi-node profiles.


def test_members_per_node_follow_the_mesh_order():
    assert members_per_node(("expert",), {"data": 2, "expert": 8}, 8) == 8
    assert members_per_node(("data",), {"data": 2, "expert": 8}, 8) == 1
    assert members_per_node(("data", "expert"), {"data": 2, "expert": 8}, 8) == 8
    assert members_per_node(("expert",), {"data": 1, "expert": 32}, 8) == 8
    assert members_per_node(("data",), {"data": 4, "expert": 2}, 8) == 4


NODES = dataclasses.replace(
    PROFILE, devices_per_node=8, node_link_bytes_per_s=1e5, node_link_latency_s=2e-5
)


def _collective(kind):
    mesh = mesh_x()
    collectives = {
        "all_to_all": lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True),
        "psum": lambda v: jax.lax.psum(v, "x"),
    }
    ops, _ = _ops(
        collectives[kind], sds(mesh, (8 * 16, 4), P("x")), in_specs=P("x"), out_specs=P("x")
    )
    return ops[kind]


def test_all_to_all_across_nodes_by_hand():
    op = _collective("all_to_all")
    operand = 16 * 4 * F32
    # 16 devices in 2 nodes: 7/16 of the buffer stays inside the node over each device's
    # link; 8/16 leaves it, and the 8 devices of the node share the node link.
    inside = operand * 7 / 16 / 1e6
    across = 8 * operand * 8 / 16 / 1e5
    expected = 1e-5 + 2e-5 + max(inside, across)
    assert CostModel(NODES, {"x": 16}).seconds(op) == pytest.approx(expected)
    # Within one node it is the flat model over the device link.
    flat = 1e-5 + operand * 7 / 8 / 1e6
    assert CostModel(NODES, {"x": 8}).seconds(op) == pytest.approx(flat)


def test_all_reduce_across_nodes_is_hierarchical():
    op = _collective("psum")
    operand = 16 * 4 * F32
    # 32 devices, 4 nodes: reduce inside the node, then across nodes (2 passes each).
    expected = 1e-5 + 2e-5 + 2 * operand * 7 / 8 / 1e6 + 2 * operand * 3 / 4 / 1e5
    assert CostModel(NODES, {"x": 32}).seconds(op) == pytest.approx(expected)


def test_shipped_hardware_profiles_document_every_figure():
    import json

    for path in sorted(PROFILE_FILES.glob("*.json")):
        data = json.loads(path.read_text())
        profile = load_profile(path)
        assert PROFILES[profile.name] == profile
        assert profile.devices_per_node == 8
        figures = {f.name for f in dataclasses.fields(DeviceProfile)} - {"name"}
        assert set(data["sources"]) >= figures - {"devices_per_node"}
    assert {"a100-8x-nvlink-400g", "v100-8x-nvlink-100g"} <= set(PROFILES)


def test_profile_files_reject_unknown_fields(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"name": "x", "flops_per_s": 1, "memory_bytes_per_s": 1, "teraflops": 3}')
    with pytest.raises(ValueError, match="teraflops"):
        load_profile(path)


def test_fused_elementwise_ops_pay_no_launch_overhead():
    mesh = mesh_x()
    ops, _ = _ops(
        lambda a, b: jnp.tanh(a @ b),
        sds(mesh, (M, K), P()),
        sds(mesh, (K, N_COLS), P()),
        in_specs=(P(), P()),
        out_specs=P(),
    )
    separate = CostModel(PROFILE, {"x": 8})
    fused = CostModel(dataclasses.replace(PROFILE, fused_elementwise=True), {"x": 8})
    tanh, dot = ops["tanh"], ops["dot_general"]
    assert separate.seconds(tanh) - fused.seconds(tanh) == pytest.approx(PROFILE.op_overhead_s)
    assert fused.seconds(dot) == separate.seconds(dot)  # a matmul still launches a kernel


def test_half_precision_matmuls_run_at_their_own_peak():
    mesh = mesh_x()
    # Large enough that the matmul is compute-bound on both peaks.
    rows = 512
    costs = CostModel(
        dataclasses.replace(PROFILE, memory_bytes_per_s=1e15, half_precision_flops_per_s=4e9),
        {"x": 8},
    )
    seconds = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        ops, _ = _ops(
            lambda a, b: a @ b,
            sds(mesh, (rows, rows), P(), dtype),
            sds(mesh, (rows, rows), P(), dtype),
            in_specs=(P(), P()),
            out_specs=P(),
        )
        dot = ops["dot_general"]
        seconds[dtype] = costs.seconds(dot) - PROFILE.op_overhead_s
        assert seconds[dtype] == pytest.approx(
            op_flops(dot) / costs.profile.peak_flops_per_s(dtype)
        )
    assert seconds[jnp.float32] == pytest.approx(4 * seconds[jnp.bfloat16])
    assert PROFILE.peak_flops_per_s(jnp.bfloat16) == PROFILE.flops_per_s  # none given


def test_fp8_matmuls_run_at_their_own_peak_and_at_16_bits_without_one():
    mesh = mesh_x()
    eight = jnp.float8_e4m3fn
    ops, _ = _ops(
        lambda a, b: jax.lax.dot_general(
            a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        ),
        sds(mesh, (512, 512), P(), eight),
        sds(mesh, (512, 512), P(), eight),
        in_specs=(P(), P()),
        out_specs=P(),
    )
    dot = ops["dot_general"]
    fast = dataclasses.replace(
        PROFILE, memory_bytes_per_s=1e15, half_precision_flops_per_s=4e9, fp8_flops_per_s=8e9
    )
    widened = dataclasses.replace(fast, fp8_flops_per_s=0.0)  # no FP8 tensor cores

    for profile, peak in ((fast, 8e9), (widened, 4e9)):
        seconds = CostModel(profile, {"x": 8}).seconds(dot) - PROFILE.op_overhead_s
        assert seconds == pytest.approx(op_flops(dot) / peak)
    h100 = device_profile("h100-8x-nvlink-3200g")
    assert h100.peak_flops_per_s(eight) == 2 * h100.peak_flops_per_s(jnp.bfloat16)
