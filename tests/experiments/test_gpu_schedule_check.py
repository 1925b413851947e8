"""The GPU check's schedule variants and device descriptions (its runs need a GPU)."""

import argparse
import dataclasses

import pytest

from experiments import gpu_schedule_check
from experiments.shared import gpu_devices
from jaxmoe.presets import preset


def test_variants_name_a_schedule_and_how_it_is_pinned_and_emitted():
    config = preset("tiny")  # two microbatches, as the check runs it: pair needs them
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, microbatches=2))

    def variant(name):
        varied, experimental = gpu_schedule_check._variant(config, name)
        schedule = varied.schedule
        groups = experimental is not None and experimental.xla_groups
        return schedule.name, "groups" if groups else schedule.xla_pin, schedule.transport

    assert variant("pair") == ("pair", "barriers", "xla")
    assert variant("pair:free") == ("pair", "none", "xla")
    assert variant("pair:groups") == ("pair", "groups", "xla")
    assert variant("lancet:sync") == ("lancet", "barriers", "sync")
    assert variant("lancet:sync:free") == ("lancet", "none", "sync")
    noprofile, _ = gpu_schedule_check._variant(config, "pair:noprofile")
    assert noprofile.schedule.xla_latencies is False
    with pytest.raises(SystemExit, match="then any of :free, :noprofile, :groups, :sync"):
        gpu_schedule_check._variant(config, "pair:fast")


def test_the_configuration_takes_the_checks_layout_and_schedule_settings():
    args = argparse.Namespace(
        preset="mixtral-tiny",
        layers=2,
        microbatches=4,
        profile="h100-8x-nvlink-3200g",
        link_mbit=5000.0,
        async_min_bytes=1024,
        expert=None,
        data=None,
    )
    config = gpu_schedule_check._config(args, devices=8)
    assert (config.parallel.data, config.parallel.expert) == (1, 8)
    assert (config.model.num_layers, config.train.microbatches) == (2, 4)
    schedule = config.schedule
    assert schedule.async_min_bytes == 1024
    # The link is told to the cost model as a profile: the named one, with that link.
    assert schedule.device_profile.link_bytes_per_s == 5000e6 / 8
    assert schedule.device_profile.flops_per_s == preset_profile().flops_per_s


def preset_profile():
    import scheduling

    return scheduling.PROFILES["h100-8x-nvlink-3200g"]


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
