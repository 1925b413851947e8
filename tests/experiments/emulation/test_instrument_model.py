"""The cluster as the simulator sees it: socket all-to-all costs, the control's order, the
readings."""

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from experiments.emulation import instrument_model
from experiments.emulation.overlap_control import ControlProgram, per_device_forms
from scheduling import Graph, Role, capture


def test_socket_all_to_all_costs_the_bytes_that_leave_the_host():
    sweep = [{"bytes": 1024, "seconds": 0.5}, {"bytes": 4096, "seconds": 2.0}]
    # Over 2 hosts of one device, half the operand crosses; over 4, three quarters.
    samples = instrument_model.socket_all_to_all_samples(sweep, 2)
    assert samples == [(2048, 0.5), (8192, 2.0)]
    samples = instrument_model.socket_all_to_all_samples(sweep, 4)
    assert [size for size, _ in samples] == pytest.approx([1024 * 4 / 3, 4096 * 4 / 3])


def _control_graph(form: str) -> Graph:
    mesh = jax.make_mesh((8,), ("x",))
    program = ControlProgram("xla", rows=64, width=16, layers=1, chunks=4)
    specs = (PartitionSpec("x"), PartitionSpec())
    x = jax.ShapeDtypeStruct((64 * 8, 16), "float32", sharding=NamedSharding(mesh, specs[0]))
    w = jax.ShapeDtypeStruct((16, 16), "float32", sharding=NamedSharding(mesh, specs[1]))
    body = per_device_forms("x", program)[form]
    program = capture(body, x, w, mesh=mesh, in_specs=specs, out_specs=specs[0])
    return Graph(program, split=lambda op: op.primitive == "all_to_all")


def _pairs(graph: Graph, order: list[int]) -> str:
    """The order's starts and dones, chunk by chunk: 'S0 S1 D0 ...'."""
    starts = [node.id for node in graph.nodes if node.role is Role.START]
    names = {start: f"S{i}" for i, start in enumerate(starts)}
    names |= {graph.nodes[start].partner: f"D{i}" for i, start in enumerate(starts)}
    return " ".join(names[node] for node in order if node in names)


def test_the_independent_control_runs_two_transfers_at_a_time():
    graph = _control_graph("independent")
    order = instrument_model.pipelined_order(graph)
    assert sorted(order) == list(range(len(graph.nodes)))
    assert all(graph.preds[node] <= set(order[:index]) for index, node in enumerate(order))
    assert _pairs(graph, order) == "S0 S1 D0 S2 D1 S3 D2 D3"
    # Chunk 0's last matmul runs after S2 and before D1: it overlaps transfer 1.
    d0, s2, d1 = (order.index(graph.nodes[n].id) for n in _ids(graph, "D0", "S2", "D1"))
    after_d0 = [n for n in order[s2:d1] if graph.has_path(order[d0], n)]
    assert any(graph.nodes[n].op.primitive == "dot_general" for n in after_d0)


def _ids(graph: Graph, *names: str) -> list[int]:
    starts = [node.id for node in graph.nodes if node.role is Role.START]
    lookup = {f"S{i}": s for i, s in enumerate(starts)}
    lookup |= {f"D{i}": graph.nodes[s].partner for i, s in enumerate(starts)}
    return [lookup[name] for name in names]


def test_the_chained_control_is_serial():
    graph = _control_graph("chained")
    order = instrument_model.pipelined_order(graph)
    assert _pairs(graph, order) == "S0 D0 S1 D1 S2 D2 S3 D3"


def test_readings_differ_only_where_they_say():
    graph = _control_graph("independent")
    order = instrument_model.pipelined_order(graph)

    def seconds(node):
        return 1.0 if node.is_collective and node.role is Role.START else 0.1

    result = instrument_model.readings(graph, order, seconds, factor=0.5)
    assert result["all_to_all_s"] == 4.0 and result["other_collectives_s"] == 0.0
    assert result["instrument"] == result["all_async"]  # the only collectives: all-to-alls
    assert result["scaled"]["compute_s"] == pytest.approx(0.5 * result["instrument"]["compute_s"])
    assert result["in_place"]["step_s"] == pytest.approx(
        result["in_place"]["compute_s"] + result["in_place"]["communication_s"]
    )
    assert result["instrument"]["step_s"] < result["in_place"]["step_s"]
