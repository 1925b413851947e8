"""Each collective's axes and purpose, read from the program, in the schedule report."""

from __future__ import annotations

import functools
from collections import Counter

import pytest

import scheduling
from scheduling.policy import ExperimentalOptions, SchedulePolicy
from scheduling.program.capture import Phase
from scheduling.program.collective_purpose import AxisRoles, collective_purposes
from tests.scheduling import folding_toys as toys
from tests.scheduling.toys import toy_program


def _purposes(layout):
    program = toys.program(layout)
    named = collective_purposes(program, toys.AXIS_ROLES)
    return Counter((named[op], op.phase.value) for op in program.collectives())


def test_the_folded_layer_names_its_collectives():
    assert _purposes(toys.FOLDED) == {
        ("tensor all_gather (sequence)", "forward"): 1,
        ("tensor reduce_scatter (sequence)", "forward"): 1,
        ("expert all_to_all (dispatch)", "forward"): 1,
        ("expert all_to_all (combine)", "forward"): 1,
        # Backward: the combine's transpose comes first, then the dispatch's.
        ("expert all_to_all (combine)", "backward"): 1,
        ("expert all_to_all (dispatch)", "backward"): 1,
        ("tensor all_gather (sequence)", "backward"): 1,
        ("gradient psum", "optimizer"): 4,
        ("data+tensor psum", "forward"): 1,  # the loss, over every axis
    }


def test_the_same_axis_is_tensor_for_attention_and_expert_tensor_for_the_moe():
    purposes = _purposes(toys.EXPERT_TENSOR)
    assert purposes["tensor all_gather (sequence)", "forward"] == 1
    assert purposes["expert-tensor all_gather", "forward"] == 1
    assert purposes["expert-tensor reduce_scatter", "forward"] == 1
    assert purposes["expert all_to_all (dispatch)", "forward"] == 1
    assert purposes["expert all_to_all (combine)", "forward"] == 1


def test_dispatch_and_combine_follow_the_data_flow_not_the_order():
    program = toys.program(toys.FOLDED)
    named = collective_purposes(program, toys.AXIS_ROLES)
    forward = [
        named[op]
        for op in program.ops
        if op.primitive == "all_to_all" and op.phase is Phase.FORWARD
    ]
    assert forward == ["expert all_to_all (dispatch)", "expert all_to_all (combine)"]


def test_a_role_table_given_as_data_names_other_axes():
    program = toy_program()  # one axis 'x', not a folded name
    default = set(collective_purposes(program).values())
    assert "x all_to_all" in default  # no layer scope: no dispatch/combine
    roles = AxisRoles({"x": ("data", "expert")})
    named = set(collective_purposes(program, roles).values())
    assert "data all_to_all" in named


def test_axis_roles_are_checked():
    with pytest.raises(ValueError, match=r"AxisRoles.roles\['x'\]"):
        AxisRoles({"x": ("data",)})


@functools.cache
def _report(layout_name, policy):
    layout = toys.LAYOUTS[layout_name]
    _, report = scheduling.optimize(
        toys.make_step(layout),
        *toys.shapes(layout),
        mesh=layout.mesh,
        in_specs=toys.in_specs(layout),
        out_specs=toys.out_specs(layout),
        policy=SchedulePolicy(name=policy, partition_chunks=2),
        experimental=ExperimentalOptions(partition_always=True),
        batch_argnums=(1,),
        axis_roles=toys.AXIS_ROLES,
    )
    return report


@pytest.mark.parametrize("policy", ["dw", "lancet"])
def test_the_report_gives_each_collective_its_axes_and_purpose(policy):
    report = _report("folded", policy)
    rows = {(c.purpose, tuple(c.axes)) for c in report.collectives}
    assert ("tensor all_gather (sequence)", ("tensor_expert",)) in rows
    assert ("tensor reduce_scatter (sequence)", ("tensor_expert",)) in rows
    assert ("expert all_to_all (dispatch)", ("expert", "tensor_expert")) in rows
    assert ("expert all_to_all (combine)", ("expert", "tensor_expert")) in rows
    assert ("gradient psum", ("data",)) in rows
    assert all(c.purpose for c in report.collectives)
    table = report.table()
    assert "expert all_to_all (dispatch)" in table and "expert,tensor_expert" in table
    assert report.to_json()["collectives"][0]["purpose"]
