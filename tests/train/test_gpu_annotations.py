"""What XLA:GPU needs to keep the plan, checked on the emitted program (no GPU needed):
every critical collective's window — its async start, the computation placed in it, its
done — carries one ``_scheduling_group_id`` of its own, and deferrable collectives none."""

import collections
import dataclasses
import functools
import re

from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.presets import preset
from jaxmoe.train.scheduled import plan_train_step

GROUP = re.compile(r'_scheduling_group_id = "(\d+)"')


@functools.cache
def planned():
    config = preset("tiny")
    config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, num_layers=2),
        schedule=dataclasses.replace(config.schedule, name="dw"),
    )
    return plan_train_step(config, build_mesh(config.parallel))


def test_each_window_is_one_scheduling_group():
    step = planned()
    text = step.stablehlo()
    dones, tagged = collections.Counter(), collections.Counter()
    for line in text.splitlines():
        match = GROUP.search(line)
        if match is None:
            continue
        group = int(match.group(1))
        tagged[group] += 1
        if "stablehlo.async_done" in line:
            dones[group] += 1
    report = step.report
    all_to_alls = [c for c in report.collectives if c.kind == "all_to_all"]
    assert all_to_alls, "the step has no split all-to-all"
    # One group per critical window: its done (and its start) carry it, nothing else's.
    assert set(dones) == set(tagged) and set(dones.values()) == {1}
    assert len(dones) >= len(all_to_alls)
    assert text.count('"stablehlo.async_start"') == text.count('"stablehlo.async_done"')
    # Deferrable collectives (the gradient reductions) are left free: fewer groups than
    # split collectives.
    assert len(dones) < text.count('"stablehlo.async_done"')
    # The dW work placed in the backward windows is traced inside its window's group:
    # beyond each group's start and done, at least one tagged op per placed dW op.
    assert report.dw_ops_placed > 0
    assert sum(tagged.values()) - 2 * len(dones) >= report.dw_ops_placed
