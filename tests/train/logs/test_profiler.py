"""``jaxmoe train --profile-steps A:B`` and ``jaxmoe schedule --trace``."""

from __future__ import annotations

import gzip
import json

import pytest

from jaxmoe.cli.main import main
from jaxmoe.config import ConfigError
from jaxmoe.train.logs.profiler import parse_profile_steps
from scheduling import read_trace
from tests.train.test_multiprocess import SMALL

# The model and data of SMALL, for both commands (--no-progress is train's alone).
MODEL = [arg for arg in SMALL if arg != "--no-progress"] + ["--steps", "6", "--schedule", "dw"]


@pytest.mark.parametrize(("text", "window"), [("3:5", (3, 5)), ("0:0", (0, 0)), ("5:5", (5, 5))])
def test_parse_profile_steps(text, window):
    assert parse_profile_steps(text, steps=6, out_dir="runs/a") == window


@pytest.mark.parametrize(
    ("text", "out_dir", "message"),
    [
        ("3", "d", "expected A:B"),
        ("3-5", "d", "expected A:B"),
        ("a:b", "d", "expected A:B"),
        ("5:3", "d", "0 <= A <= B < 6"),
        ("3:6", "d", "0 <= A <= B < 6"),
        ("-1:2", "d", "0 <= A <= B < 6"),
        ("3:5", None, "needs --out DIR"),
    ],
)
def test_parse_profile_steps_refuses(text, out_dir, message):
    with pytest.raises(ConfigError, match=message):
        parse_profile_steps(text, steps=6, out_dir=out_dir)


@pytest.mark.parametrize("text", ["3", "5:3", "3:6"])
def test_bad_profile_steps_is_one_line_and_status_2_before_training(
    text, tmp_path, capsys, monkeypatch
):
    def must_not_run(*args, **kwargs):
        raise AssertionError("train() ran: the flag was not checked first")

    monkeypatch.setattr("jaxmoe.train.loop.train", must_not_run)
    out = tmp_path / "run"

    status = main(["train", *MODEL, "--profile-steps", text, "--out", str(out)])

    error = capsys.readouterr().err
    assert status == 2
    assert error.count("\n") == 1 and error.startswith("jaxmoe train: error: --profile-steps")
    assert not out.exists()


def test_profile_steps_without_out_is_refused(capsys):
    assert main(["train", *MODEL, "--profile-steps", "3:5"]) == 2
    assert "needs --out DIR" in capsys.readouterr().err


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled")
    args = ["train", *MODEL, "--no-progress", "--profile-steps", "3:5", "--out", str(out)]
    assert main(args) == 0
    return out


def test_profile_steps_writes_a_trace_of_those_steps(profiled_run):
    # Where TensorBoard's profile plugin looks: plugins/profile/<session>/ in a log
    # directory that holds the run's event files.
    log_dir = profiled_run / "tensorboard"
    assert list(log_dir.glob("events.out.tfevents.*"))
    (trace_file,) = (log_dir / "plugins" / "profile").glob("*/*.trace.json.gz")
    assert list(trace_file.parent.glob("*.xplane.pb"))  # XProf's copy, beside it
    with gzip.open(trace_file, "rt") as file:
        events = json.load(file)["traceEvents"]  # the file parses

    marked = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert marked == [3, 4, 5]
    measured = read_trace(trace_file)
    # Exactly the three steps, whole, on every device, with the step's collectives.
    assert (measured.steps, measured.devices) == (3, 8)
    assert any(op.startswith("all-to-all") for op in measured.seconds)
    assert any(op.startswith("psum_start") or "all-reduce" in op for op in measured.seconds)


def test_a_scheduled_run_saves_its_schedule_report(profiled_run):
    assert json.loads((profiled_run / "schedule_report.json").read_text())["policy"] == "dw"
    assert json.loads((profiled_run / "config.json").read_text())["schedule"]["name"] == "dw"


def test_schedule_lists_the_ops_the_cost_model_mis_estimates(profiled_run, tmp_path, capsys):
    out = tmp_path / "inspect"

    status = main(["schedule", *MODEL, "--trace", str(profiled_run), "--out", str(out)])

    printed = capsys.readouterr().out
    assert status == 0
    table = printed[printed.index("measured trace of") :]
    assert "another configuration" not in table
    rows = table.splitlines()[3:]
    assert any("all_to_all@" in row for row in rows)
    comparison = json.loads((out / "trace_comparison.json").read_text())
    assert comparison["steps"] == 3 and comparison["groups"]
    assert all(group["measured_seconds"] > 0 for group in comparison["groups"])
    both = json.loads((out / "measured_vs_simulated.json").read_text())
    assert {event["pid"] for event in both["traceEvents"]} == {0, 1}


def test_schedule_trace_without_a_trace_is_one_line_and_status_2(tmp_path, capsys):
    status = main(["schedule", *MODEL, "--trace", str(tmp_path)])

    error = capsys.readouterr().err
    assert status == 2
    assert error.count("\n") == 1 and "no *.trace.json.gz" in error
