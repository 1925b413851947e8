"""The convergence evaluation's arithmetic on made-up runs: paired ratios, steps to a target,
and the costs file ``train.grad_sync auto`` reads (the runs themselves are measurements,
in experiments/results/grad_sync_convergence.md)."""

import pytest

from experiments.grad_sync_convergence import (
    CLUSTER_HOSTS,
    convergence_costs,
    convergence_ratios,
    steps_to,
    summarise,
)


def run(algorithm: str, seed: int, losses: list[float], per_host: int = CLUSTER_HOSTS) -> dict:
    return {
        "algorithm": algorithm,
        "seed": seed,
        "devices_per_host": per_host,
        "loss": losses,
        "val_loss": {str(len(losses)): losses[-1] + 0.1},
    }


def test_steps_to_counts_steps_until_the_target_is_reached():
    assert steps_to([5.0, 4.0, 3.0, 2.0], 3.0) == 3
    assert steps_to([5.0, 4.0], 3.0) is None


def test_a_run_twice_as_slow_costs_two_steps_per_allreduce_step():
    reference = run("allreduce", 0, [10.0 - i for i in range(10)])
    slower = run("delayed", 0, [10.0 - i / 2 for i in range(10)])
    # allreduce reaches 10 - 4 = 6 after 5 steps (window 1); the slower run after 9.
    assert convergence_ratios(slower, reference, 1, 0.5) == pytest.approx(9 / 5)
    assert convergence_ratios(reference, reference, 1, 0.5) == 1.0
    assert convergence_ratios(slower, reference, 1, 0.9) is None  # 10 - 8 never reached


def test_summary_pairs_seeds_and_the_costs_file_keeps_the_cluster_hosts():
    curve = [10.0 - i for i in range(10)]
    result = {
        "command": "python -m experiments.grad_sync_convergence",
        "steps": 10,
        "window": 1,
        "seeds": [0, 1],
        "runs": [
            run("allreduce", 0, curve),
            run("allreduce", 1, [x + 1 for x in curve]),
            run("int8", 0, [x * 1.01 for x in curve]),
            run("int8", 1, [(x + 1) * 1.03 for x in curve]),
            run("int8", 0, curve, per_host=1),
        ],
    }
    table = summarise(result)
    row = table[f"int8 (hosts of {CLUSTER_HOSTS})"]
    assert row["seeds"] == [0, 1]
    assert row["final_ratio"]["low"] == pytest.approx(1.01)
    assert row["final_ratio"]["high"] == pytest.approx(1.03)
    assert table["int8 (hosts of 1)"]["final_ratio"]["median"] == 1.0
    costs = convergence_costs(result, table, 0.7)
    assert set(costs["steps_per_allreduce_step"]) == {"int8"}  # the cluster's hosts only
    assert costs["target_fraction"] == 0.7
    assert costs["source"].startswith(result["command"])
