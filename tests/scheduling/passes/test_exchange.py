"""The exchange decomposition (``comet``): recognition, exactness, costs and the choice."""

import dataclasses
from collections import Counter

import chex
import jax
import pytest
from jax.sharding import PartitionSpec as P

import scheduling
from scheduling.costs.cost_model import CostModel
from scheduling.passes.decompose_exchange import decompose_program, values_needed_whole
from scheduling.passes.exchange_regions import all_decompositions, find_exchanges
from scheduling.policy import ExperimentalOptions, SchedulePolicy
from scheduling.profiles import PROFILES, DeviceProfile
from scheduling.program.capture import Op, Phase, Value
from scheduling.search.exchange_choice import choose_exchanges
from scheduling.search.schedule import schedule
from scheduling.search.step_estimate import node_seconds
from tests.scheduling.passes import exchange_toys as toys
from tests.scheduling.toys import mesh_2x4, mesh_x, reference

FAST_COMPUTE_SLOW_LINK = DeviceProfile("toy-slow-link", 1e9, 1e9, 0.0, 1e5, 0.0)
FREE_LINK = DeviceProfile("toy-free-link", 1e9, 1e9, 1e-6, 1e15, 0.0)


def _optimized(
    policy, mix_sources=False, mesh=None, in_specs=toys.IN_SPECS, token_spec=None, exchange=None
):
    mesh = mesh or mesh_x()
    token_spec = token_spec or P("x")
    axis = "x" if "x" in mesh.shape else "expert"
    axes = tuple(mesh.axis_names)
    step = toys.make_step(axis, mix_sources, axes)
    optimized, report = scheduling.optimize(
        step,
        *toys.shapes(mesh, token_spec),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=toys.OUT_SPECS,
        policy=policy,
        experimental=ExperimentalOptions(exchange=exchange),
    )
    expected = reference(step, mesh, in_specs, toys.OUT_SPECS)
    return optimized, expected, report


def test_forward_and_backward_exchanges_are_recognised():
    program = toys.program()
    exchanges = find_exchanges(program)
    assert [e.phase(program) for e in exchanges] == [Phase.FORWARD, Phase.BACKWARD]
    all_to_alls = [i for i, op in enumerate(program.ops) if op.primitive == "all_to_all"]
    assert sorted(p for e in exchanges for p in (e.dispatch, e.combine)) == all_to_alls
    assert all(e.group == 8 and e.axis == 0 for e in exchanges)
    assert {e.layer(program) for e in exchanges} == {"layer_0/moe"}


def test_rounds_and_chunks_apply_and_mixing_sources_stops_rounds():
    names = {
        str(r.decomposition)
        for regions in all_decompositions(toys.program(), (2, 4)).values()
        for r in regions
    }
    assert names == {"rounds:8", "chunks:2", "chunks:4"}
    # A mean over sources between the all-to-alls: a piece would need every source.
    mixed = all_decompositions(toys.program(mix_sources=True), (2, 4))
    assert all(r.decomposition.kind != "rounds" for rs in mixed.values() for r in rs)
    assert any(regions for regions in mixed.values())


# Eight chunks are another count of the pieces two check: slow.
@pytest.mark.parametrize(
    "decomposition", ["rounds:8", "chunks:2", pytest.param("chunks:8", marks=pytest.mark.slow)]
)
def test_decomposed_step_is_bitwise_equal(decomposition):
    policy = SchedulePolicy(name="comet")
    optimized, expected, report = _optimized(policy, exchange=decomposition)
    args = toys.args()
    chex.assert_trees_all_equal(optimized(*args), expected(*args))
    assert [x.decomposition for x in report.exchanges] == [decomposition]


def test_decomposed_step_on_a_two_axis_mesh_is_bitwise_equal():
    policy = SchedulePolicy(name="comet")
    spec = P(("data", "expert"))
    optimized, expected, _ = _optimized(
        policy, mesh=mesh_2x4(), in_specs=toys.IN_SPECS_2X4, token_spec=spec, exchange="rounds:4"
    )
    args = toys.args(mesh_2x4(), spec)
    chex.assert_trees_all_equal(optimized(*args), expected(*args))


def test_rounds_send_every_peer_once_and_keep_the_local_block():
    policy = SchedulePolicy(name="comet")
    scheduled = schedule(
        toys.program(), policy, experimental=ExperimentalOptions(exchange="rounds:8")
    )
    collectives = Counter(op.primitive for op in scheduled.graph.program.ops if op.is_collective)
    # Two exchanges, each 7 rounds out and 7 back; round 0 stays on the device.
    assert collectives["all_to_all"] == 0
    assert collectives["ppermute"] == 2 * 2 * 7
    shifts = sorted(
        {
            op.eqn.params["perm"][0][1]
            for op in scheduled.graph.program.ops
            if op.primitive == "ppermute"
        }
    )
    assert shifts == list(range(1, 8))


def test_backward_takes_the_forward_pieces_without_reassembly():
    program = toys.program()
    regions = [
        p
        for regions in all_decompositions(program, (2,)).values()
        for p in regions
        if str(p.decomposition) == "rounds:8"
    ]
    forward, backward = sorted(regions, key=lambda p: p.begin)
    needed = values_needed_whole(program, regions)
    # Residuals read only by the backward region's pieces are never reassembled.
    shared = set(forward.escaping) & set(backward.seeds)
    assert shared and not shared & needed
    alone = values_needed_whole(program, [forward])
    assert shared <= alone
    gathers = Counter(op.primitive for op in decompose_program(program, regions).ops)["gather"]
    gathers_apart = sum(
        Counter(op.primitive for op in decompose_program(program, [r]).ops)["gather"]
        for r in regions
    )
    assert gathers < gathers_apart


def test_choice_follows_the_cost_model():
    program = toys.program()
    slow = choose_exchanges(
        program, node_seconds(CostModel(FAST_COMPUTE_SLOW_LINK, {"x": 8})), (2, 4)
    )
    free = choose_exchanges(program, node_seconds(CostModel(FREE_LINK, {"x": 8})), (2, 4))
    (slow_layer,), (free_layer,) = slow, free
    assert slow_layer.chosen is not None
    assert slow_layer.estimated_seconds < slow_layer.undecomposed_seconds
    # Nothing to hide: every decomposition only adds work, and the layer is left alone.
    assert free_layer.chosen is None and "slower" in free_layer.why


def test_comet_report_lists_each_layer_and_is_never_estimated_slower():
    for profile in (FAST_COMPUTE_SLOW_LINK, FREE_LINK):
        _, _, report = _optimized(SchedulePolicy(name="comet", profile=profile))
        (layer,) = report.exchanges
        assert layer.layer == "layer_0/moe" and layer.phases == ["forward", "backward"]
        assert layer.candidates and layer.estimated_gain_seconds >= 0
        _, _, plain = _optimized(SchedulePolicy(name="async", profile=profile))
        assert report.step_seconds <= plain.step_seconds
        assert "MoE layer layer_0/moe" in report.table()


def test_ppermute_cost_follows_its_pairs_on_a_node_profile():
    profile = PROFILES["a100-8x-nvlink-400g"]
    cost = CostModel(profile, {"expert": 16})
    x = jax.ShapeDtypeStruct((4, 1024), jax.numpy.float32)

    def shifted(shift):
        perm = [(j, (j + shift) % 16) for j in range(16)]
        closed = jax.make_jaxpr(
            lambda v: jax.lax.ppermute(v, "expert", perm), axis_env=[("expert", 16)]
        )(x)
        (eqn,) = closed.jaxpr.eqns
        return Op(0, eqn, (Value(eqn.invars[0].aval),), (Value(eqn.outvars[0].aval),), "")

    bytes_ = 4 * 1024 * 4
    inside = profile.link_latency_s + profile.node_link_latency_s
    # Shift 1: one device per node leaves it; shift 8: all eight share the node link.
    assert cost.seconds(shifted(1)) == pytest.approx(
        inside + bytes_ / profile.node_link_bytes_per_s
    )
    assert cost.seconds(shifted(8)) == pytest.approx(
        inside + 8 * bytes_ / profile.node_link_bytes_per_s
    )
    cost_8 = CostModel(profile, {"expert": 8})  # one node: the device link only
    perm8 = [(j, (j + 1) % 8) for j in range(8)]
    closed = jax.make_jaxpr(
        lambda v: jax.lax.ppermute(v, "expert", perm8), axis_env=[("expert", 8)]
    )(x)
    (eqn,) = closed.jaxpr.eqns
    op = Op(0, eqn, (Value(eqn.invars[0].aval),), (Value(eqn.outvars[0].aval),), "")
    assert cost_8.seconds(op) == pytest.approx(
        profile.link_latency_s + bytes_ / profile.link_bytes_per_s
    )


def test_ppermute_groups_on_one_node_share_its_link():
    """A ring over ``data`` across two nodes of four: the four groups (one per expert
    index) each send one operand off every node at once, over the one node link."""
    profile = dataclasses.replace(PROFILES["a100-8x-nvlink-400g"], devices_per_node=4)
    sizes = {"data": 2, "expert": 4}
    x = jax.ShapeDtypeStruct((4, 1024), jax.numpy.float32)
    closed = jax.make_jaxpr(
        lambda v: jax.lax.ppermute(v, "data", [(0, 1), (1, 0)]),
        axis_env=[("data", 2), ("expert", 4)],
    )(x)
    (eqn,) = closed.jaxpr.eqns
    op = Op(0, eqn, (Value(eqn.invars[0].aval),), (Value(eqn.outvars[0].aval),), "")
    bytes_ = 4 * 1024 * 4
    assert CostModel(profile, sizes).seconds(op) == pytest.approx(
        profile.link_latency_s
        + profile.node_link_latency_s
        + 4 * bytes_ / profile.node_link_bytes_per_s
    )


@pytest.mark.parametrize(
    ("policy", "exchange", "message"),
    [
        ("comet", "rounds", "ExperimentalOptions.exchange='rounds': write rounds:G"),
        ("comet", "chunks:1", "chunks:N"),
        ("dw", "chunks:2", "applies to the comet and lancet\\+comet policies, not 'dw'"),
    ],
)
def test_the_forced_decomposition_is_checked_against_the_policy(policy, exchange, message):
    with pytest.raises(ValueError, match=message):
        ExperimentalOptions(exchange=exchange).check(SchedulePolicy(name=policy))
