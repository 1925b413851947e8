"""Training-step rounds on an emulated host: the order of the rounds, and the host program
run in one process (8 fake devices, no distributed runtime)."""

import json

from experiments.emulation import step_rounds
from experiments.emulation.host_process import round_order
from jaxmoe.cli.parser import config_from_train_args

from .small import SMALL


def test_rounds_alternate_their_order():
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert round_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_step_rounds_compiles_each_schedule_once_and_times_every_round(tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config_from_train_args(SMALL).to_dict()))
    out = tmp_path / "rounds.json"
    argv = ["--config", str(config_path), "--schedules", "none,async"]
    assert step_rounds.main([*argv, "--rounds", "2", "--warmup", "1", "--json", str(out)]) == 0
    rounds = step_rounds.StepRounds.from_json(json.loads(out.read_text()))
    assert rounds.orders == (("async", "none"), ("none", "async"))
    assert set(rounds.compile_s) == {"none", "async"}
    for seconds in rounds.seconds.values():
        assert len(seconds) == 2 and all(s > 0 for s in seconds)


def test_a_schedule_entry_sets_the_chunk_count():
    config = config_from_train_args([])
    chunked = step_rounds.with_schedule(config, "expert_pipeline:4")
    assert chunked.schedule.name == "expert_pipeline"
    assert chunked.schedule.partition_chunks == 4
    assert step_rounds.with_schedule(chunked, "dw").schedule.partition_chunks is None
