"""The GPU check's schedule variants and device descriptions (its runs need a GPU)."""

import pytest

from experiments import gpu_schedule_check
from experiments.shared import gpu_devices
from jaxmoe.presets import preset


def test_variants_name_a_schedule_without_groups_or_with_synchronous_collectives():
    config = preset("tiny")
    plain = gpu_schedule_check._variant(config, "pair").schedule
    free = gpu_schedule_check._variant(config, "pair:free").schedule
    sync = gpu_schedule_check._variant(config, "lancet:sync").schedule
    assert (plain.name, plain.xla_groups, plain.transport) == ("pair", True, "xla")
    assert (free.name, free.xla_groups, free.transport) == ("pair", False, "xla")
    assert (sync.name, sync.xla_groups, sync.transport) == ("lancet", True, "sync")
    with pytest.raises(SystemExit, match="NAME:free or NAME:sync"):
        gpu_schedule_check._variant(config, "pair:fast")


def test_the_devices_are_described_as_what_ran():
    import jax

    kind = jax.devices()[0].device_kind
    assert gpu_devices.describe(jax.devices()) == f"8 x {kind}"
    assert gpu_devices.describe([], aot=8).startswith(f"8 x {kind} in one node, compiled ahead")
    assert gpu_devices.describe([], mock=8).startswith(f"8 GPUs mocked on 1 x {kind}")
