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


def test_a_target_description_is_found_by_model_name_or_path(tmp_path):
    shipped = gpu_devices.target_file("h100_sxm")
    assert shipped.parent == gpu_devices.TARGETS
    assert "core_count: 132" in shipped.read_text()
    own = tmp_path / "mine.txtpb"
    own.write_text("gpu_device_info {}")
    assert gpu_devices.target_file(str(own)) == own
    with pytest.raises(SystemExit, match="name one of h100_sxm or a path"):
        gpu_devices.target_file("b200")


def test_devices_compiled_from_a_target_are_described_by_their_own_kind():
    class Device:
        device_kind = "NVIDIA H100 80GB HBM3"

    described = gpu_devices.describe([Device()], aot=8, target=gpu_devices.target_file("h100_sxm"))
    assert described.startswith("8 x NVIDIA H100 80GB HBM3 in one node, compiled ahead of")
    assert "`h100_sxm.txtpb` (no GPU attached" in described


def test_a_target_needs_the_aot_devices():
    with pytest.raises(SystemExit):
        gpu_schedule_check.main(["--aot-target", "h100_sxm"])
