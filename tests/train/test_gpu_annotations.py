"""What XLA:GPU needs to keep the plan, checked on the emitted program (no GPU needed):
each critical window that holds a matrix product is one ``_scheduling_group_id`` of its
own — its async start, its done and the products placed in it, nothing else — and
deferrable collectives carry none (:mod:`scheduling.runtime.xla_groups`)."""

import collections
import dataclasses
import functools
import re

from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.presets import preset
from jaxmoe.train.scheduled import plan_train_step

GROUP = re.compile(r'_scheduling_group_id = "(\d+)"')
OP = re.compile(r'= "?(stablehlo\.\w+)')


@functools.cache
def planned(name: str, xla_groups: bool = True):
    config = preset("tiny")
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, num_layers=2),
        train=dataclasses.replace(config.train, microbatches=2),
        # A slow link: the all-to-alls' windows hold the other microbatch's work.
        schedule=dataclasses.replace(
            config.schedule, name=name, link_mbit=100, xla_groups=xla_groups
        ),
    )
    return plan_train_step(config, build_mesh(config.parallel))


def _groups(text: str) -> dict[int, collections.Counter]:
    groups: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in text.splitlines():
        match = GROUP.search(line)
        if match is None:
            continue
        # An async start is a region op: its attributes close the region, "}) {...}".
        start = line.lstrip().startswith("})") and "!stablehlo.future" in line
        op = "stablehlo.async_start" if start else OP.search(line).group(1)
        groups[int(match.group(1))][op] += 1
    return groups


def test_each_group_is_a_start_a_done_and_products_placed_between():
    step = planned("pair")
    text = step.stablehlo()
    groups = _groups(text)
    assert groups, "no window became a group"
    for ops in groups.values():
        assert ops.pop("stablehlo.async_start") == 1 and ops.pop("stablehlo.async_done") == 1
        assert ops and set(ops) == {"stablehlo.dot_general"}
    # Deferrable collectives (the gradient reductions) are left free: fewer groups than
    # split collectives.
    assert len(groups) < text.count('"stablehlo.async_done"')
    # The pairing puts the other microbatch's products in the all-to-alls' windows.
    all_to_alls = [c for c in step.report.collectives if c.kind == "all_to_all"]
    assert len(groups) >= len(all_to_alls) // 2


def test_without_xla_groups_the_program_carries_none():
    text = planned("pair", xla_groups=False).stablehlo()
    assert "stablehlo.async_start" in text and "_scheduling_group_id" not in text
