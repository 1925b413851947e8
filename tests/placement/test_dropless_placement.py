"""The placement planner in dropless mode (an even device load from the smoothed routed
counts) and the routing history it plans from. Pure NumPy: nothing is compiled."""

import dataclasses

import numpy as np
import pytest

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig
from jaxmoe.experimental import ExperimentalOptions
from jaxmoe.placement.planner import balanced_table, device_loads, plan_placement
from jaxmoe.placement.replicas import EMPTY, replicas_per_expert, static_placement
from jaxmoe.placement.routing_history import RoutingHistory

EXPERTS, DEVICES = 8, 4  # two experts per device, one replica slot each
SKEWED = np.array([400.0, 40, 30, 20, 100, 80, 10, 0])


def _excess(table: np.ndarray, load: np.ndarray) -> float:
    loads = device_loads(table, load)
    return loads.max() / loads.mean() - 1


def test_device_loads_split_each_expert_evenly_over_its_copies():
    table = np.array([[4], [0], [0], [EMPTY]])  # expert 0 has 3 copies, expert 4 two
    loads = device_loads(table, SKEWED)
    per_copy = SKEWED / replicas_per_expert(table, EXPERTS)
    assert per_copy[0] == pytest.approx(400 / 3) and per_copy[4] == 50
    np.testing.assert_allclose(
        loads,
        [per_copy[0] + 40 + 50, 30 + 20 + 400 / 3, 50 + 80 + 400 / 3, 10 + 0],
    )
    assert loads.sum() == pytest.approx(SKEWED.sum())


def test_balanced_table_lowers_the_excess_load_of_the_static_placement():
    static = static_placement(EXPERTS, DEVICES, 3)
    table = balanced_table(static, SKEWED)
    assert _excess(table, SKEWED) < 0.5 * _excess(static, SKEWED)
    # The hottest expert gets the most copies, never two on one device (home included).
    copies = replicas_per_expert(table, EXPERTS)
    assert copies.argmax() == 0 and copies.sum() <= EXPERTS + table.size
    for device in range(DEVICES):
        held = [2 * device, 2 * device + 1, *table[device][table[device] >= 0].tolist()]
        assert len(held) == len(set(held))


def test_balanced_table_keeps_copies_in_their_slots_and_is_stable():
    table = balanced_table(static_placement(EXPERTS, DEVICES, 4), SKEWED)
    again = balanced_table(table, SKEWED)
    np.testing.assert_array_equal(again, table)
    shuffled = table[:, ::-1].copy()  # the same copies in other slots stay where they are
    np.testing.assert_array_equal(balanced_table(shuffled, SKEWED), shuffled)


def test_history_predicts_the_last_step_blended_with_its_smoothed_mean():
    history = RoutingHistory({"tokens_per_expert": (1.0, 0.5)})
    history.update([{"step": 0, "tokens_per_expert": [4.0]}])
    history.update([{"step": 1, "tokens_per_expert": [1.0]}])
    # Step 0 weighs half of step 1 in the mean: (0.5 * 4 + 1) / 1.5 = 2.
    np.testing.assert_allclose(history.mean("tokens_per_expert"), [2.0])
    np.testing.assert_allclose(history.predict("tokens_per_expert"), [0.5 * 1 + 0.5 * 2])
    history.update([{"step": 0, "tokens_per_expert": [7.0]}])  # a step seen: a new run
    np.testing.assert_allclose(history.predict("tokens_per_expert"), [7.0])
    with pytest.raises(KeyError):
        history.mean("kept_by_copies")
    with pytest.raises(ValueError, match="half-life"):
        RoutingHistory({"tokens_per_expert": (0.0, 0.5)})


def _config(rebalance: int = 1) -> Config:
    return Config(
        model=ModelConfig(d_model=16, num_heads=2, num_layers=2, d_ff=32, seq_len=16),
        moe=MoEConfig(
            num_experts=EXPERTS,
            capacity_factor=None,
            dropless_dispatch="ragged",
            slots_per_device=3,
            rebalance_every=rebalance,
        ),
        parallel=ParallelConfig(data=2, expert=DEVICES),
    )


def test_dropless_plan_follows_the_smoothed_load_not_one_step():
    """A burst of one step on a cold expert does not move the copies planned from a long
    skew; the decisions say what each layer's table does to the largest device load."""
    config = _config()
    static = static_placement(EXPERTS, DEVICES, 3)[None]
    history = RoutingHistory({"tokens_per_expert": (64.0, 0.3)})
    rows = [{"step": s, "tokens_per_expert": SKEWED[None]} for s in range(20)]
    table, decisions = plan_placement(static, rows, config, 20, history)
    (decision,) = decisions
    assert decision["change"] == "place" and decision["applied"]
    assert decision["max_over_mean_after"] < decision["max_over_mean_before"]
    assert _excess(table[0], SKEWED) < 0.5 * _excess(static[0], SKEWED)
    burst = SKEWED[::-1].copy()[None]
    rows = [{"step": 20, "tokens_per_expert": burst}]
    after_burst, _ = plan_placement(table, rows, config, 21, history)
    # Planned from the burst alone, the copies would suit the long skew far worse.
    burst_only = balanced_table(table[0], burst[0])
    assert _excess(after_burst[0], SKEWED) < 0.5 * _excess(burst_only, SKEWED)


def test_dropless_plan_without_a_history_uses_the_planners_own_per_configuration():
    config = dataclasses.replace(_config(), train=dataclasses.replace(_config().train, seed=7))
    static = static_placement(EXPERTS, DEVICES, 3)[None]
    rows = [{"step": 0, "tokens_per_expert": SKEWED[None]}]
    first, _ = plan_placement(static, rows, config, 1)
    second, _ = plan_placement(first, [{"step": 1, "tokens_per_expert": SKEWED[None]}], config, 2)
    np.testing.assert_array_equal(second, first)


def test_balanced_device_loads_are_what_the_step_splits():
    table = np.array([[4], [0], [0], [EMPTY]])
    loads = device_loads(table, SKEWED, "balanced")
    assert loads.sum() == pytest.approx(SKEWED.sum())
    # Devices 0-2 share expert 0 (and 0, 2 expert 4): the split levels them; device 3
    # holds experts 6 and 7 alone.
    np.testing.assert_allclose(loads[:3], (SKEWED.sum() - 10) / 3, rtol=1e-5)
    assert device_loads(table, SKEWED).max() > loads.max() * 1.05


def _balanced_plan(rows_load: np.ndarray, steps: int = 8):
    config, balanced = _config(), ExperimentalOptions(replica_split="balanced")
    static = static_placement(EXPERTS, DEVICES, 3)[None]
    rows = [{"step": s, "tokens_per_expert": rows_load[None]} for s in range(steps)]
    return static, *plan_placement(static, rows, config, steps, RoutingHistory(), balanced)


def test_with_the_balanced_split_a_spread_table_that_balances_stays():
    """The round-robin planner would move copies for this skew; under the step's own split
    the spread table already evens the devices out, so the planner writes nothing."""
    mild = np.array([160.0, 120, 100, 90, 80, 70, 60, 40])
    static, table, decisions = _balanced_plan(mild)
    np.testing.assert_array_equal(table, static)
    assert not any(d["applied"] for d in decisions)
    round_robin, _ = plan_placement(
        static,
        [{"step": 0, "tokens_per_expert": mild[None]}],
        _config(),
        1,
        experimental=ExperimentalOptions(replica_split="round_robin"),
    )
    assert np.any(round_robin != static)


def test_with_the_balanced_split_a_skew_beyond_the_spread_gets_more_copies():
    static, table, (decision,) = _balanced_plan(SKEWED)
    assert decision["applied"]
    assert decision["max_over_mean_after"] < decision["max_over_mean_before"]
    assert device_loads(table[0], SKEWED, "balanced").max() < (
        device_loads(static[0], SKEWED, "balanced").max()
    )
    assert replicas_per_expert(table[0], EXPERTS)[0] > replicas_per_expert(static[0], EXPERTS)[0]
