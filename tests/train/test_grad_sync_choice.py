"""``train.grad_sync auto``: estimates from the cost model, a choice that follows the link."""

import dataclasses
import json

import pytest
from jax.sharding import Mesh

from jaxmoe.cli.main import main
from jaxmoe.config import ParallelConfig
from jaxmoe.parallel import mesh as mesh_module
from jaxmoe.parallel.grad_sync import ALGORITHMS, EXACT
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.plan.grad_sync_choice import RELAXED_SPEEDUP, choose_grad_sync, resolve_grad_sync

from .runs import small_config, with_schedule


def config_told(link_mbit: float, **train_fields):
    config = small_config(grad_sync="auto", grad_sync_devices_per_host=4, **train_fields)
    config = with_schedule(config, profile="cpu", link_mbit=link_mbit)
    return dataclasses.replace(config, parallel=ParallelConfig(data=2, expert=4))


@pytest.fixture(scope="module")
def choices():
    mesh = build_mesh(ParallelConfig(data=2, expert=4))
    return {link: choose_grad_sync(config_told(link), mesh) for link in (1.0, 1e6)}


def test_every_algorithm_is_estimated_and_the_slower_link_costs_more(choices):
    slow, fast = choices[1.0], choices[1e6]
    assert [e.name for e in slow.estimates] == list(ALGORITHMS)
    for slow_estimate, fast_estimate in zip(slow.estimates, fast.estimates, strict=True):
        assert slow_estimate.sync_seconds > fast_estimate.sync_seconds
    by_name = {e.name: e for e in slow.estimates}
    # 8-bit codes across the 2 data replicas of the expert gradients: fewer bytes.
    assert by_name["int8"].sync_seconds < by_name["allreduce"].sync_seconds
    assert by_name["decentralized-int8"].sync_seconds < by_name["decentralized"].sync_seconds


def test_a_slow_link_picks_a_relaxed_algorithm_and_a_fast_one_an_exact_one(choices):
    slow, fast = choices[1.0], choices[1e6]
    assert slow.chosen not in EXACT
    best_exact = min(e.step_seconds for e in slow.estimates if e.exact)
    chosen = next(e for e in slow.estimates if e.name == slow.chosen)
    assert best_exact / chosen.step_seconds >= RELAXED_SPEEDUP
    assert fast.chosen in EXACT
    assert f"grad_sync auto -> {fast.chosen}" in fast.table()
    assert "1 Mbit/s between hosts" in slow.table()


def test_resolve_leaves_a_named_algorithm_alone():
    config = small_config(grad_sync="int8")
    assert resolve_grad_sync(config, build_mesh(config.parallel)) == (config, None)


def test_train_says_what_auto_chose_and_runs_it(tmp_path, capsys, monkeypatch):
    built = []
    counted = lambda *args, **kwargs: built.append(Mesh(*args, **kwargs)) or built[-1]
    monkeypatch.setattr(mesh_module, "Mesh", counted)
    out = tmp_path / "run"
    argv = ["train", "--steps", "2", "--no-progress", "--out", str(out)]
    argv += ["--parallel.data", "2", "--parallel.expert", "4", "--train.grad_sync", "auto"]
    argv += ["--train.grad_sync_devices_per_host", "4", "--schedule.profile", "cpu"]
    argv += ["--schedule.link_mbit", "1", "--model.num_layers", "2"]
    assert main(argv) == 0
    # One preparation: the mesh is built once, the choice made once, for the whole run.
    assert len(built) == 1
    chosen = json.loads((out / "grad_sync_choice.json").read_text())
    assert chosen["chosen"] in ALGORITHMS
    assert {e["name"] for e in chosen["estimates"]} == set(ALGORITHMS)
    # The run records the algorithm it ran, so that --resume finds its state.
    assert json.loads((out / "config.json").read_text())["train"]["grad_sync"] == chosen["chosen"]
    assert f"grad_sync auto -> {chosen['chosen']}" in capsys.readouterr().out
