"""Expert placements timed side by side on an emulated host: the variants, and the host
program run in one process (8 fake devices, no distributed runtime)."""

import json

import pytest

from experiments.emulation import placement_rounds
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import ConfigError

from .small import SMALL


def test_variants_differ_only_in_their_placement():
    config = config_from_train_args(["--moe.slots_per_device", "2", "--moe.rebalance_every", "1"])
    variants = placement_rounds.variant_configs(config)
    assert variants["no replicas"].replica_slots == 0
    assert variants["static"].replica_slots == variants["dynamic"].replica_slots == 1
    assert variants["static"].moe.rebalance_every == 0
    assert variants["dynamic"].moe.rebalance_every == 1
    # Equal buffers: the capacity is sized over the slots, so the bytes are the same.
    assert variants["no replicas"].moe.capacity_factor == variants["static"].moe.capacity_factor
    with pytest.raises(ConfigError, match="replica slots"):
        placement_rounds.variant_configs(config_from_train_args([]))


def test_rounds_time_every_variant_and_replan_only_the_dynamic_one(tmp_path):
    overrides = [*SMALL, "--moe.slots_per_device", "2", "--moe.rebalance_every", "1"]
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config_from_train_args(overrides).to_dict()))
    out = tmp_path / "rounds.json"
    argv = ["--config", str(config_path), "--rounds", "3", "--warmup", "1", "--json", str(out)]
    assert placement_rounds.main(argv) == 0
    rounds = placement_rounds.PlacementRounds.from_json(json.loads(out.read_text()))
    assert set(rounds.seconds) == set(placement_rounds.VARIANTS)
    for name in placement_rounds.VARIANTS:
        assert len(rounds.seconds[name]) == 3 and all(s > 0 for s in rounds.seconds[name])
        assert all(0 <= d <= 1 for d in rounds.dropped_fraction[name])
    # Re-planned after every step from live routing, the dynamic table moves.
    assert len(rounds.planning_s) == len(rounds.changed_slots) == 3
    assert sum(rounds.changed_slots) > 0
    assert placement_rounds.PlacementRounds.from_json(rounds.to_json()) == rounds
