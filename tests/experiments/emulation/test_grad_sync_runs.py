"""The gradient-sync algorithms trained by the host program across two real processes (on
loopback: the algorithms' collectives between processes, not the link, are under test)."""

import json
import math

import pytest

from experiments.emulation.grad_sync_runs import read_runs, rotated
from jaxmoe.cli.launch import launch
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.parallel.grad_sync import ALGORITHMS

from .small import SMALL

# Each algorithm compiles its own step (about 5 s a process here), so the algorithms whose
# collectives across processes are tested elsewhere are left out: allreduce and hierarchical
# (tests/train/test_multiprocess.py), and bucketed, allreduce's psums in buckets, equal to it
# bit for bit (tests/train/test_grad_sync.py).
ACROSS_PROCESSES = ("int8", "decentralized", "decentralized-int8", "delayed")
# decentralized's ring across the processes is decentralized-int8's, which sends 8-bit codes
# on it; delayed's collectives across the processes are the grouped psums hierarchical runs
# across them (tests/train/test_multiprocess.py), its state is held per device as int8's
# residual is, and its algorithm is tested in one process (tests/train/test_grad_sync.py):
# each runs by itself in the slow tier.
BY_DEFAULT = ("int8", "decentralized-int8")


@pytest.mark.parametrize(
    "algorithms",
    [
        pytest.param(BY_DEFAULT, id="int8-ring"),
        pytest.param(("decentralized",), id="decentralized", marks=pytest.mark.slow),
        pytest.param(("delayed",), id="delayed", marks=pytest.mark.slow),
    ],
)
def test_the_relaxed_algorithms_train_across_two_processes(tmp_path, algorithms):
    """Two processes, each a host of 4 devices (train.grad_sync_devices_per_host 0): the
    grouped collectives of int8 (in-host and cross-host groups from the processes), the
    ring of the decentralized ones and the delayed state all run across processes, one
    after another from one start of each process, and every one of them learns."""
    assert set(ACROSS_PROCESSES) <= set(ALGORITHMS)
    flags = [*SMALL, "--parallel.data", "2", "--parallel.expert", "4", "--moe.num_experts", "4"]
    flags += ["--train.steps", "3", "--train.warmup_steps", "1", "--train.eval_batches", "1"]
    flags += ["--train.learning_rate", "1e-2"]
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config_from_train_args(flags).to_dict()))
    prefix = tmp_path / "runs"
    args = ["--config", str(config_path), "--algorithms", ",".join(algorithms)]
    # The steps differ by algorithm; initialisation and validation are shared through the
    # persistent cache.
    args += ["--json", str(prefix), "--compilation-cache", str(tmp_path / "cache")]
    with (tmp_path / "log").open("w") as log:
        status = launch(args, 2, module="experiments.emulation.grad_sync_runs", output=log)
    assert status == 0, (tmp_path / "log").read_text()[-3000:]
    for host in range(2):
        runs = read_runs(prefix, host)
        assert [run.algorithm for run in runs] == list(algorithms)
        for run in runs:
            assert len(run.loss) == 3 and all(math.isfinite(x) for x in run.loss)
        first = {run.algorithm: run.loss[0] for run in runs}
        # Step 0's loss comes before any synchronisation: the same for every algorithm.
        assert max(first.values()) - min(first.values()) < 1e-5, first
        for run in runs:
            if run.algorithm != "delayed":  # delayed makes no update at step 0
                assert run.loss[-1] < run.loss[0], run
            else:
                assert run.loss[-1] < run.loss[1], run


def test_repeats_rotate_the_order():
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
