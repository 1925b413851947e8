"""Reading a jax.profiler trace and matching its XLA ops to the scheduled ops."""

from __future__ import annotations

import gzip
import json

import jax
import pytest

import scheduling
from scheduling.reports import measured_trace
from scheduling.reports.measured_trace import HloOpKeys, compare, hlo_op_keys, key_of, read_trace
from tests.scheduling.toys import in_specs as toy_in_specs
from tests.scheduling.toys import mesh_x, out_specs, toy_args, toy_step


@pytest.mark.parametrize(
    ("op_name", "key"),
    [
        (
            "jit(run)/shard_map/transpose(jvp(layer_1))/moe/dot_general",
            ("transpose(jvp(layer_1))/moe", "dot_general"),
        ),
        ("jit(run)/shard_map/jvp(layer_0)/all_to_all_start", ("jvp(layer_0)", "all_to_all")),
        ("jit(run)/shard_map/grad/psum_done", ("grad", "psum")),
        ("jit(run)/shard_map/mul", ("", "mul")),
        ("clip/reduce_sum", ("clip", "reduce_sum")),  # XLA dropped the outer scopes
        ("jit(run)/shard_map", None),  # only the enclosing scope
        ("jit(run)/shard_map/broadcast.104", None),  # an instruction XLA made
        ("jit(run)/shard_map/my_start", ("", "my_start")),  # not a collective
    ],
)
def test_key_of_reads_name_stack_and_primitive(op_name, key):
    assert key_of(op_name) == key


HLO = """\
HloModule jit_run

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.9 = f32[] add(%a, %b), metadata={op_name="jit(run)/shard_map/other/add"}
}

%fused_computation.3 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %exp.1 = f32[4]{0} exponential(%p), metadata={op_name="jit(run)/shard_map/jvp(l0)/exp"}
  ROOT %mul.2 = f32[4]{0} multiply(%exp.1, %exp.1), metadata={op_name="jit(run)/shard_map/jvp(l0)/mul"}
}

ENTRY %main.7_spmd (x: f32[4]) -> f32[] {
  %x = f32[4]{0} parameter(0)
  %fusion.3 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation.3, metadata={op_name="jit(run)/shard_map/jvp(l0)/mul;jit(run)/shard_map/jvp(l0)/exp"}
  %reduce.4 = f32[] reduce(%fusion.3, %c), dimensions={0}, to_apply=%region_0.1, metadata={op_name="jit(run)/shard_map/jvp(l0)/reduce_sum"}
  ROOT %all-reduce.5 = f32[] all-reduce(%reduce.4), to_apply=%region_0.1, metadata={op_name="jit(run)/shard_map/grad/psum_start"}
}
"""  # noqa: E501


def test_hlo_op_keys_follow_fusions_but_not_shared_reducers():
    keys = hlo_op_keys(HLO)

    mul, exp = ("jvp(l0)", "mul"), ("jvp(l0)", "exp")
    assert keys["fusion.3"] == HloOpKeys(own=(mul, exp), held=frozenset({mul, exp}))
    # The reducer region is shared: following it would tie the reduce to the psum.
    assert keys["reduce.4"].held == {("jvp(l0)", "reduce_sum")}
    assert keys["all-reduce.5"].held == {("grad", "psum")}
    assert keys["x"] == HloOpKeys(own=(), held=frozenset())


def _event(name, run, device, ts, dur, module="jit_run"):
    args = {"hlo_op": name, "hlo_module": module, "run_id": run, "device_ordinal": device}
    return {"ph": "X", "pid": 1, "tid": device, "name": name, "ts": ts, "dur": dur, "args": args}


def _write_trace(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": events}, file)


def test_read_trace_keeps_complete_runs_and_averages_per_device(tmp_path):
    events = [_event("fusion.3", "1", "0", 0, 50)]  # the tail of a step already running
    for run, start in (("2", 100), ("3", 300)):
        for device in ("0", "1"):
            events += [
                _event("fusion.3", run, device, start, 10 + int(device)),
                _event("all-reduce.5", run, device, start + 20, 30),
            ]
    events.append(_event("copy.1", "9", "0", 500, 1, module="jit_put"))
    events.append({"ph": "X", "pid": 1, "tid": 0, "name": "train", "ts": 0, "dur": 1000})
    _write_trace(tmp_path / "plugins/profile/run/host.trace.json.gz", events)

    measured = read_trace(tmp_path)

    assert (measured.module, measured.steps, measured.devices) == ("jit_run", 2, 2)
    assert measured.seconds == pytest.approx({"fusion.3": 10.5e-6, "all-reduce.5": 30e-6})
    assert measured.step_seconds == pytest.approx(50e-6)
    names, starts, seconds = zip(*measured.timeline, strict=True)
    assert names == ("fusion.3", "all-reduce.5")
    assert starts == pytest.approx((0.0, 20e-6)) and seconds == pytest.approx((10e-6, 30e-6))


def test_read_trace_takes_ops_by_their_hlo_name_where_events_name_kernels(tmp_path):
    # As a GPU's kernels are traced: the event names the kernel, its args the XLA op, and
    # neither an execution nor a device ordinal (the device is the trace's process).
    def kernel(name, op, pid, ts, dur):
        args = {"hlo_op": op, "hlo_module": "jit_run"}
        return {"ph": "X", "pid": pid, "tid": 7, "name": name, "ts": ts, "dur": dur, "args": args}

    events = [
        kernel("sm90_xmma_gemm_bf16", "gemm_fusion_dot.4", 3, 0, 40),
        kernel("loop_add_fusion", "loop_add_fusion", 3, 40, 10),
        kernel("sm90_xmma_gemm_bf16", "gemm_fusion_dot.4", 3, 60, 20),
    ]
    _write_trace(tmp_path / "plugins/profile/run/host.trace.json.gz", events)
    measured = read_trace(tmp_path)
    assert (measured.steps, measured.devices) == (1, 1)
    assert measured.seconds == pytest.approx({"gemm_fusion_dot.4": 60e-6, "loop_add_fusion": 10e-6})
    assert [name for name, *_ in measured.timeline] == [
        "gemm_fusion_dot.4",
        "loop_add_fusion",
        "gemm_fusion_dot.4",
    ]


def test_find_trace_file_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"trace\.json\.gz"):
        measured_trace.find_trace_file(tmp_path)


def _simulated(*ops):
    events = []
    for stack, primitive, us in ops:
        args = {"name_stack": stack, "primitive": primitive}
        events.append({"ph": "X", "name": primitive, "ts": 0, "dur": us, "args": args})
    return {"traceEvents": events}


def test_compare_counts_every_second_once():
    measured = measured_trace.MeasuredOps(
        module="jit_run",
        steps=1,
        devices=1,
        seconds={"fusion.3": 4e-6, "reduce.4": 1e-6, "all-reduce.5": 9e-6, "copy.7": 2e-6},
        step_seconds=20e-6,
    )
    simulated = _simulated(
        ("jvp(l0)", "mul", 1.0),
        ("jvp(l0)", "exp", 2.0),  # fused into the mul's fusion: joins its row
        ("jvp(l0)", "reduce_sum", 1.0),
        ("grad", "psum", 3.0),
        ("jvp(l1)", "tanh", 5.0),  # in no traced op
    )

    comparison = compare(measured, HLO, simulated, 12e-6)

    psum, mul, reduce = ("psum@grad",), ("mul@jvp(l0)", "exp@jvp(l0)"), ("reduce_sum@jvp(l0)",)
    measured_rows = {g.scheduled_ops: g.measured_seconds for g in comparison.groups}
    estimated_rows = {g.scheduled_ops: g.estimated_seconds for g in comparison.groups}
    assert measured_rows == pytest.approx({psum: 9e-6, mul: 4e-6, reduce: 1e-6})
    assert estimated_rows == pytest.approx({psum: 3e-6, mul: 3e-6, reduce: 1e-6})
    assert comparison.groups[0].scheduled_ops == ("psum@grad",)  # largest error first
    assert comparison.unmatched_scheduled_ops == pytest.approx({"tanh@jvp(l1)": 5e-6})
    assert comparison.unmatched_xla_ops == {"copy.7": 2e-6}
    assert comparison.traced_ops_not_in_module == ["copy.7"]
    assert "another configuration" in comparison.table()


# --- A real trace of a small scheduled step --------------------------------------------------


def _profiled_toy_step(trace_dir):
    policy = scheduling.SchedulePolicy(name="dw", profile=scheduling.PROFILES["cpu"])
    step, report = scheduling.optimize(
        toy_step,
        *toy_args(),
        mesh=mesh_x(),
        in_specs=toy_in_specs(),
        out_specs=out_specs(),
        policy=policy,
    )
    args = toy_args()
    compiled = step.lower(*args).compile()
    jax.block_until_ready(step(*args))  # compiled and warm before the trace
    jax.profiler.start_trace(trace_dir)
    for _ in range(3):
        jax.block_until_ready(step(*args))
    jax.profiler.stop_trace()
    return compiled.as_text(), report


def test_a_profiled_step_matches_its_scheduled_ops(tmp_path_factory):
    trace_dir = str(tmp_path_factory.mktemp("trace"))
    hlo_text, report = _profiled_toy_step(trace_dir)

    measured = read_trace(trace_dir)
    comparison = compare(measured, hlo_text, report.trace, report.step_seconds)

    assert measured.steps == 3 and measured.devices == 8
    assert comparison.traced_ops_not_in_module == []
    matched = {op for group in comparison.groups for op in group.scheduled_ops}
    # Each layer's matmul and all-to-all, forward and backward, is found in the trace:
    # the emitted step keeps the original name stacks in XLA's metadata.
    for layer in ("layer_0", "layer_1"):
        assert f"all_to_all@jvp({layer})" in matched
        assert f"all_to_all@transpose(jvp({layer}))" in matched
        assert f"dot_general@jvp({layer})" in matched
    assert all(g.measured_seconds > 0 for g in comparison.groups)
    total_measured = sum(g.measured_seconds for g in comparison.groups)
    total_measured += sum(comparison.unmatched_xla_ops.values())
    assert total_measured == pytest.approx(sum(measured.seconds.values()))
    total_estimated = sum(g.estimated_seconds for g in comparison.groups)
    total_estimated += sum(comparison.unmatched_scheduled_ops.values())
    estimated = measured_trace.estimated_seconds(report.trace)
    assert total_estimated == pytest.approx(sum(estimated.values()))
    table = comparison.table()
    assert "mis-estimates most" in table and "all_to_all@" in table

    both = measured_trace.side_by_side(report.trace, measured)
    measured_events = [e for e in both["traceEvents"] if e.get("pid") == 1 and e["ph"] == "X"]
    assert len(measured_events) == len(measured.timeline) > 0
