"""``jaxmoe train``: overrides, files written, and exit status 2 on bad input."""

import json
import subprocess
import sys

import pytest

from jaxmoe.train.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--moe.top_k", "9"], "moe.top_k=9 is larger than moe.num_experts=8"),
        (["train", "--moe.capacity_factor", "abc"], "--moe.capacity_factor: cannot read 'abc'"),
        (["train", "--parallel.data", "2"], "2 x 8 = 16, but there are 8 devices"),
        (["train", "--preset", "huge"], "invalid choice: 'huge'"),
        (["train", "--no-such-flag", "1"], "unrecognized arguments: --no-such-flag"),
        (["train", "--steps", "many"], "invalid int value: 'many'"),
    ],
)
def test_bad_input_is_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        status = main(argv)
        raise SystemExit(status)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error
    assert error.count("\n") == 1, error


def test_console_exit_status_in_a_fresh_process():
    result = subprocess.run(
        [sys.executable, "-m", "jaxmoe.train.cli", "train", "--moe.capacity_factor", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "jaxmoe train: error: moe.capacity_factor=0.0: must be > 0, or None for dropless routing"
    )


def test_a_short_run_writes_config_and_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--steps", "3", "--out", str(out), "--no-progress"]
    argv += ["--model.num_layers", "2", "--model.d_model", "32", "--moe.capacity_factor", "none"]
    argv += ["--train.eval_every", "2", "--data.max_bytes", "300000"]
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["num_layers"] == 2 and config["moe"]["capacity_factor"] is None
    assert config["train"]["steps"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for key in ("loss", "tokens_per_s", "dropped_fraction", "expert_imbalance", "aux_loss"):
        assert all(key in row for row in rows), key
    assert "val_loss" in rows[1] and "val_loss" in rows[2]
    assert all(row["dropped_fraction"] == 0 for row in rows)
    assert "done: 3 steps" in capsys.readouterr().out
