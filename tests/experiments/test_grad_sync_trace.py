"""The gradient-sync trace's comparison: traced XLA ops set beside the estimates of the
equations they hold (full runs are measurements, in experiments/results/)."""

import pytest

from experiments.grad_sync_trace import _sizes, compare, format_markdown

SYNC = ("grad_reduce", "param_mix")


def test_sizes_of_an_array_and_of_a_tuple():
    assert _sizes("u8[2,515,1024]{2,1,0} all-gather(%x), channel_id=1") == [2 * 515 * 1024]
    assert _sizes("(f32[], f32[571392]{0}) all-reduce(%a, %b)") == [1, 571392]


def test_each_traced_op_gets_the_estimate_of_what_it_holds():
    """Two all-gathers of one key take one equation each, by size; a combined all-reduce
    takes one equation per result; a fusion takes the rest of its keys."""
    gather = ["grad_reduce/bucket0", "all_gather"]
    measured = {
        "ops": {
            "all_gather.1": {
                "seconds": 0.020,
                "collective": True,
                "keys": [gather],
                "text": "u8[2,100]{1,0} all-gather(%a)",
            },
            "all_gather.2": {
                "seconds": 0.005,
                "collective": True,
                "keys": [gather],
                "text": "f32[2,1]{1,0} all-gather(%b)",
            },
            "all-reduce.1": {
                "seconds": 0.010,
                "collective": True,
                "keys": [["clip", "psum"], ["grad_reduce/bucket1", "psum"]],
                "text": "(f32[], f32[64]{0}) all-reduce(%c, %d)",
            },
            "ynn_fusion.6": {
                "seconds": 0.100,
                "collective": False,
                "keys": [["grad_reduce/bucket0", "reduce_sum"]],
                "text": "f32[100]{0} fusion(%e)",
            },
            "dot.1": {
                "seconds": 0.200,
                "collective": False,
                "keys": [["layer_0/attention", "dot_general"]],
                "text": "f32[8,8]{1,0} dot(%f, %g)",
            },
        }
    }
    estimated = {
        "ops": [
            {"key": gather, "collective": True, "elements": 2, "seconds": 0.001},
            {"key": gather, "collective": True, "elements": 200, "seconds": 0.030},
            {"key": ["clip", "psum"], "collective": True, "elements": 1, "seconds": 0.002},
            {
                "key": ["grad_reduce/bucket1", "psum"],
                "collective": True,
                "elements": 64,
                "seconds": 0.003,
            },
            {
                "key": ["grad_reduce/bucket0", "reduce_sum"],
                "collective": False,
                "elements": 100,
                "seconds": 0.0006,
            },
            {
                "key": ["layer_0/attention", "dot_general"],
                "collective": False,
                "elements": 64,
                "seconds": 0.150,
            },
        ]
    }
    result = compare(measured, estimated, SYNC)
    rows = {row["op"]: row for row in result["sync_ops"]}
    assert rows["all_gather.1"]["estimated_s"] == pytest.approx(0.030)
    assert rows["all_gather.2"]["estimated_s"] == pytest.approx(0.001)
    assert rows["all-reduce.1"]["estimated_s"] == pytest.approx(0.005)
    assert rows["ynn_fusion.6"]["estimated_s"] == pytest.approx(0.0006)
    assert "dot.1" not in rows  # not the synchronisation's
    groups = result["groups"]
    assert groups["sync collective"] == pytest.approx({"measured": 0.035, "estimated": 0.036})
    assert groups["sync compute"] == pytest.approx({"measured": 0.100, "estimated": 0.0006})
    assert groups["rest compute"] == pytest.approx({"measured": 0.200, "estimated": 0.150})
    assert result["estimated_unmatched_s"] == 0.0

    row = {**result, "step_s": [0.4, 0.5, 0.6], "traced_step_s": 0.45, "estimated_step_s": 0.2}
    text = format_markdown(
        {
            "command": "sudo .venv/bin/python -m experiments.grad_sync_trace",
            "machine": "test",
            "rounds": 3,
            "warmup": 1,
            "op_costs": "analytic",
            "links": {"300": {"estimate_link": "test link", "algorithms": {"int8": row}}},
        }
    )
    assert "| int8 | 500 [400-600] | 450 | 200 | 100 / 1 | 35 / 36 | 200 / 150 | 0 / 0 |" in text
    assert "| ynn_fusion.6 | compute | reduce_sum | 100.0 | 0.6 |" in text
