"""What XLA:GPU needs to keep the plan, checked on the emitted train step (no GPU
needed): pinned by barriers (the default), each critical window with computation in it
is bounded by two optimization barriers and carries one ``_scheduled_window`` of its own
(:mod:`scheduling.runtime.xla_barriers`), and the step is compiled with as many
collectives in flight as its plan has; as scheduling groups, each window that holds
a matrix product is one ``_scheduling_group_id`` — its async start, its done and the
products placed in it, nothing else — and deferrable collectives carry none
(:mod:`scheduling.runtime.xla_groups`)."""

import collections
import dataclasses
import functools
import re
from unittest import mock

import scheduling.runtime.pinning
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.presets import preset
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import scheduled_train_step
from scheduling.program import jax_adapter
from scheduling.runtime.pinning import OVERLAP_LIMIT_OPTION
from tests.train.runs import linked

GROUP = re.compile(r'_scheduling_group_id = "(\d+)"')
WINDOW = re.compile(r'_scheduled_window = "(\d+)"')
OP = re.compile(r'= "?((?:stablehlo|chlo)\.\w+)')


@functools.cache
def planned(name: str, xla_pin: str = "barriers"):
    """The train step as emitted for a GPU mesh, on the CPUs of the tests (groups: as
    emitted for these CPUs)."""
    if xla_pin == "groups":
        return _plan(name, xla_pin)
    with mock.patch.object(scheduling.runtime.pinning, "target_platform", lambda mesh: "gpu"):
        return _plan(name, xla_pin)


def _plan(name: str, xla_pin: str):
    config = preset("tiny")
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, num_layers=2),
        train=dataclasses.replace(config.train, microbatches=2),
        # A slow link: the all-to-alls' windows hold the other microbatch's work.
        schedule=dataclasses.replace(config.schedule, name=name, profile=linked("a100", 100)),
    )
    # Scheduling groups are a research option; the policy's pin is barriers or none.
    if xla_pin == "groups":
        experimental = scheduling.ExperimentalOptions(xla_groups=True)
        return scheduled_train_step(resolve(config, build_mesh(config.parallel)), experimental)
    config = dataclasses.replace(
        config, schedule=dataclasses.replace(config.schedule, xla_pin=xla_pin)
    )
    return scheduled_train_step(resolve(config, build_mesh(config.parallel)))


def _groups(text: str, attribute=GROUP) -> dict[int, collections.Counter]:
    groups: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in text.splitlines():
        match = attribute.search(line)
        if match is None:
            continue
        half = jax_adapter.stablehlo_async_half(line)
        if half is not None:
            op = half
        elif line.lstrip().startswith("})"):  # a region op's attributes follow its region
            op = "a region op"
        else:
            op = OP.search(line).group(1)
        groups[int(match.group(1))][op] += 1
    return groups


def test_each_window_is_a_start_a_done_and_computation_between_two_barriers():
    step = planned("pair")
    text = step.stablehlo()
    windows = _groups(text, WINDOW)
    assert windows, "no window was pinned"
    for ops in windows.values():
        assert ops.pop("start") == 1 and ops.pop("done") == 1
        assert ops  # the computation the plan placed inside
    # Two barriers a window, beside the model's own (the attention core's backward pass).
    own = planned("pair", "none").stablehlo().count("stablehlo.optimization_barrier")
    assert text.count("stablehlo.optimization_barrier") == 2 * len(windows) + own
    assert "_scheduling_group_id" not in text
    # Deferrable collectives (the gradient reductions) are left free.
    assert len(windows) < jax_adapter.stablehlo_async_pairs(text)[1]
    # The pairing runs one microbatch's all-to-all beside the other's: the step is
    # compiled with at least that many collectives in flight.
    pinned = step.step.pinned
    assert pinned.in_flight >= 2
    assert pinned.compiler_options() == {OVERLAP_LIMIT_OPTION: pinned.in_flight}


def test_each_group_is_a_start_a_done_and_products_placed_between():
    step = planned("pair", "groups")
    text = step.stablehlo()
    groups = _groups(text)
    assert groups, "no window became a group"
    for ops in groups.values():
        assert ops.pop("start") == 1 and ops.pop("done") == 1
        assert ops and set(ops) == {"stablehlo.dot_general"}
    # Deferrable collectives (the gradient reductions) are left free: fewer groups than
    # split collectives.
    assert len(groups) < jax_adapter.stablehlo_async_pairs(text)[1]
    # The pairing puts the other microbatch's products in the all-to-alls' windows.
    all_to_alls = [c for c in step.report.collectives if c.kind == "all_to_all"]
    assert len(groups) >= len(all_to_alls) // 2


def test_unpinned_the_windows_are_marked_and_not_held():
    text = planned("pair", "none").stablehlo()
    assert jax_adapter.stablehlo_async_pairs(text)[0] > 0 and "_scheduled_window" in text
    assert "_scheduling_group_id" not in text
    # The only barriers are the model's own (2 microbatches, 2 blocks): in each block the
    # one-tile attention core's output (a buffer of its own) and its backward pass, and the
    # experts' activation recomputed from its input (jaxmoe/layers/activations.py); each
    # norm's input, read as the residual stream holds it, that barrier's transpose, and the
    # norm recomputed from its input (jaxmoe/layers/norms.py): two norms a block, and the
    # final one.
    norms = 3 * (2 * 2 + 1)
    assert text.count("stablehlo.optimization_barrier") == 2 * (3 * 2 + norms)
