"""Reading the scheduled windows back from a compiled HLO module."""

import re

from scheduling.runtime.hlo_windows import (
    async_pairs,
    broken_windows,
    kept_windows,
    windows,
    without_window_scope,
)

G0 = 'frontend_attributes={_scheduling_group_id="0"}'
G1 = 'frontend_attributes={_scheduling_group_id="1"}'
T = "f32[8,4]{1,0}"
KEPT = f"""HloModule step, is_scheduled=true

ENTRY %main (p0: f32[8,4]) -> f32[8,4] {{
  %p0 = {T} parameter(0)
  %a2a-start = ({T}, {T}) all-to-all-start(%p0), {G0}
  %fusion.1 = {T} fusion(%p0), kind=kLoop, calls=%f, {G0}
  %dot.2 = {T} dot(%fusion.1, %p0), {G0}
  %a2a-done = {T} all-to-all-done(%a2a-start), {G0}
  %ar-start = {T} all-reduce-start(%dot.2), {G1}
  %ar-done = {T} all-reduce-done(%ar-start), {G1}
  ROOT %add = {T} add(%a2a-done, %ar-done)
}}
"""


def test_a_kept_window_and_one_turned_synchronous():
    found = windows(KEPT)
    assert set(found) == {0, 1}
    assert found[0].kept and (found[0].start, found[0].done) == (1, 4)
    assert found[0].inside == [2, 3] and found[0].why == ""
    # Nothing between start and done: the compiler runs it synchronously.
    assert [w.group for w in broken_windows(KEPT)] == [1]
    assert found[1].why == "nothing inside"
    # A collective with no async pair left (combined with another, or synchronous).
    combined = KEPT.replace("all-reduce-start(%dot.2)", "all-reduce(%dot.2)")
    assert windows(combined)[1].why.startswith("no async start and done")


def test_compute_moved_out_of_its_window_is_reported():
    moved = KEPT.replace(
        "  %a2a-done = f32[8,4]{1,0} all-to-all-done(%a2a-start), "
        'frontend_attributes={_scheduling_group_id="0"}\n',
        "",
    ).replace(
        "  %fusion.1 =",
        "  %a2a-done = f32[8,4]{1,0} all-to-all-done(%a2a-start), "
        'frontend_attributes={_scheduling_group_id="0"}\n  %fusion.1 =',
    )
    assert 0 in [w.group for w in broken_windows(moved)]
    assert windows(moved)[0].why == "2 of 2 after its done"


# As XLA:GPU prints an async all-to-all: a nested tuple shape, operands with their shapes.
ASYNC = f"""HloModule step, is_scheduled=true

ENTRY %main (p0: f32[8,4]) -> f32[8,4] {{
  %p0 = {T} parameter(0)
  %all-to-all-start = (({T}), {T}) async-start({T} %p0), calls=%all-to-all.1, {G0}
  %gemm = {T} custom-call({T} %p0, {T} %p0), custom_call_target="__cublas$gemm", {G0}
  %bitcast.3 = {T} bitcast({T} %gemm)
  %all-to-all-done = {T} async-done((({T}), {T}) %all-to-all-start), {G0}
  %all-reduce-start = {T} all-reduce-start({T} %bitcast.3), to_apply=%add
  %all-reduce-done = {T} all-reduce-done({T} %all-reduce-start)
  ROOT %add = {T} add({T} %all-to-all-done, {T} %all-reduce-done)
}}
"""


def test_async_pairs_and_what_runs_between():
    pairs = async_pairs(ASYNC)
    assert [(p.kind, p.start, p.done, p.between) for p in pairs] == [
        ("all-to-all", 1, 4, 1),  # the gemm; the bitcast computes nothing
        ("all-reduce", 5, 6, 0),
    ]
    assert [p.overlapped for p in pairs] == [True, False]
    assert windows(ASYNC)[0].kept


# As XLA:GPU compiles JAX's async halves (jax 0.12, an H100 target): the start and done
# keep their op_name, which holds the window's scope, and lose their frontend attributes;
# the computation inside keeps the attribute.
W2 = 'frontend_attributes={_scheduled_window="2"}'
SCOPE = 'metadata={{op_name="jit(run)/shard_map/moe/_scheduled_window=2/all_to_all_{}"}}'
SCOPED = f"""HloModule step, is_scheduled=true

ENTRY %main (p0: f32[8,4]) -> f32[8,4] {{
  %p0 = {T} parameter(0)
  %all-to-all-start.8 = (({T}), {T}) async-start(%p0), calls=%c, {SCOPE.format("start")}
  %fusion.4 = {T} fusion(%p0), kind=kLoop, calls=%f, {W2}, metadata={{op_name="jit(run)/mul"}}
  %all-to-all-done.8 = {T} async-done(%all-to-all-start.8), {SCOPE.format("done")}
  ROOT %add = {T} add(%all-to-all-done.8, %fusion.4)
}}
"""


def test_a_window_is_read_from_its_collectives_op_name_where_xla_drops_their_attributes():
    window = windows(SCOPED)[2]
    assert (window.start, window.done, window.inside, window.kept) == (1, 3, [2], True)
    assert without_window_scope("microbatch_0/moe/_scheduled_window=2") == "microbatch_0/moe"
    assert without_window_scope("_scheduling_group_id=12/layer_0") == "layer_0"
    assert without_window_scope("layer_0/x_scheduled_window=2") == "layer_0/x_scheduled_window=2"


def test_kept_windows_counts_the_emitted_windows_against_the_kept_ones():
    kept = kept_windows(3, KEPT, "as scheduling groups")
    assert (kept.emitted, kept.kept, kept.collectives, kept.overlapped) == (3, 1, 2, 1)
    assert (kept.scheduled, kept.placed) == (2, 2)
    assert kept.line().startswith(
        "XLA kept 1 of 3 scheduled windows (as scheduling groups), 2 of their 2 instructions "
        "inside; 1 of 2 async"
    )
    assert "own" not in kept.line()


def test_a_module_that_kept_no_window_says_the_order_is_the_compilers():
    dropped = re.sub(r", frontend_attributes=\{[^}]*\}", "", KEPT)
    kept = kept_windows(3, dropped)
    assert (kept.emitted, kept.kept) == (3, 0)
    assert kept.line().endswith("the compiled order is the compiler's own, not the schedule")


W0 = 'frontend_attributes={_scheduled_window="0"}'
# A window marked by number: one product moved before the start, one kept inside, and a
# bookkeeping copy of the window's (a bitcast) that computes nothing.
MARKED = f"""HloModule step, is_scheduled=true

ENTRY %main (p0: f32[8,4]) -> f32[8,4] {{
  %p0 = {T} parameter(0)
  %dot.1 = {T} dot(%p0, %p0), {W0}
  %a2a-start = ({T}, {T}) all-to-all-start(%p0), {W0}
  %dot.2 = {T} dot(%dot.1, %p0), {W0}
  %bitcast.3 = {T} bitcast(%dot.2), {W0}
  %a2a-done = {T} all-to-all-done(%a2a-start), {W0}
  ROOT %add = {T} add(%a2a-done, %bitcast.3)
}}
"""


def test_windows_marked_by_number_and_what_runs_outside_them():
    (window,) = windows(MARKED).values()
    assert (window.start, window.done, window.inside) == (2, 5, [1, 3])
    assert window.placed == 1 and not window.kept
    kept = kept_windows(1, MARKED, "pinned by barriers")
    assert (kept.scheduled, kept.placed) == (2, 1)


def test_a_program_emitted_without_groups_says_why():
    kept = kept_windows(0, KEPT, withheld="the compiler crashes on them")
    assert kept.line() == (
        "scheduled windows not emitted as scheduling groups (the compiler crashes on them); "
        "1 of 2 async collectives have computation inside"
    )
