"""``jaxmoe train``: overrides, files written, and exit status 2 on bad input."""

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxmoe.cli import launch as launch_module
from jaxmoe.cli.main import main
from jaxmoe.cli.parser import config_from_train_args, parse, resolve_config
from jaxmoe.config import Config, DataSource, MoEConfig, TrainConfig
from jaxmoe.presets import preset
from tests.train.runs import ONE_LAYER

# A refusal takes a parse and a file read; a compilation of even the smallest step takes
# far longer on these hosts, so a refusal within this bound proves none happened.
REFUSED_WITHIN_S = 15.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--moe.top_k", "9"], "moe.top_k=9 is larger than moe.num_experts=8"),
        (["train", "--moe.capacity_factor", "abc"], "--moe.capacity_factor: cannot read 'abc'"),
        (["train", "--parallel.data", "2"], "2 x 8 x 1 = 16, but there are 8 devices"),
        (["train", "--preset", "huge"], "invalid choice: 'huge'"),
        (["train", "--no-such-flag", "1"], "unrecognized argument --no-such-flag: see jaxmoe"),
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


@pytest.fixture
def input_files(tmp_path):
    """A directory, a text file too short for one sequence and one long enough (and a link
    to it), an odd-sized upper-case .BIN,
    a .bin with ids beyond the byte vocabulary, and curve files the cost model cannot use."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "short.txt").write_text("hello")
    (tmp_path / "long.txt").write_text("hello world " * 500)
    (tmp_path / "link.txt").symlink_to(tmp_path / "long.txt")
    (tmp_path / "odd.BIN").write_bytes(b"abc")
    (np.arange(5000, dtype="<u2") % 1000).tofile(tmp_path / "wide.bin")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "empty.json").write_text('{"curves": []}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "typo.json").write_text(
        '{"curves": [{"kind": "alltoall", "group_size": 8, "bytes": [1], "seconds": [1]}]}'
    )
    (tmp_path / "typo.toml").write_text("[model]\nd_mode = 64\n")
    return tmp_path


CURVES = "--schedule.link_curves"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([CURVES, "{dir}/absent.json"], "absent.json': no such file or directory"),
        ([CURVES, "{dir}/adir"], "adir': is a directory"),
        ([CURVES, "{dir}/broken.json"], "broken.json': not valid JSON: "),
        ([CURVES, "{dir}/list.json"], "list.json': expected an object"),
        ([CURVES, "{dir}/empty.json"], "empty.json': curves is empty"),
        ([CURVES, "{dir}/typo.json"], "curves[0].kind='alltoall' is not a collective"),
        (["--step-timeout", "-1"], "--step-timeout -1: must be a number of seconds > 0"),
        (["--step-timeout", "0"], "--step-timeout 0: must be a number of seconds > 0"),
        (["--step-timeout", "inf"], "--step-timeout inf: must be a number of seconds > 0"),
        (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be at least 1 second"),
        (["--data", "{dir}/adir"], "adir' is a directory; give a text file or a .bin"),
        (["--data", "{dir}/absent.txt"], "absent.txt': no such file"),
        (["--data", "{dir}/odd.BIN"], "a .bin must hold uint16 token ids (even byte count)"),
        (["--data", "{dir}/short.txt"], "the training split of '{dir}/short.txt' has 4 tokens"),
        (["--data", "{dir}/wide.bin"], "wide.bin' holds token id 999"),
        (["--data", "{dir}/long.txt:0"], "long.txt' has weight 0.0: a weight is a finite number"),
        (["--data", "{dir}/long.txt", "{dir}/long.txt:2"], "long.txt' is given twice"),
        (["--data", "{dir}/long.txt", "{dir}/link.txt"], "link.txt' and '{dir}/long.txt' are the"),
        (
            ["--data", "{dir}/long.txt:3", "{dir}/wide.bin", "--model.vocab_size", "1000"],
            "holds ids without a sidecar: a mixture's corpora share one tokenizer",
        ),
        (["--steps", "3", "--train.steps", "5"], "--steps 3 and --train.steps 5 disagree"),
        (["--data", "a.txt", "--data.sources", "b.txt"], "--data a.txt and --data.sources b.txt"),
        (["--data.path", "a.txt"], "--data.path is now --data.sources (or --data FILE)"),
        (["--schedule", "dw", "--schedule.name", "async"], "--schedule dw and --schedule.name"),
        (["--train.schedule", "dw"], "--train.schedule is now --schedule.name"),
        (["--model.d_model", "1000000000"], "the attention projections would have 3e+18"),
        (["--model.d_ff", str(10**16)], "the dense FFN weights would have 1.28e+18"),
        (
            ["--config", "{dir}/typo.toml"],
            "--config {dir}/typo.toml: unknown field model.d_mode: did you mean model.d_model?",
        ),
        (["--config", "{dir}/absent.toml"], "absent.toml: no such file or directory"),
    ],
)
def test_bad_inputs_are_refused_before_compiling(input_files, argv, message, capsys):
    argv = [arg.format(dir=input_files) for arg in argv]
    message = message.format(dir=input_files)
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["train", *argv, "--out", str(input_files / "run")]))
    elapsed = time.monotonic() - started
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error
    assert error.count("\n") == 1, error
    assert elapsed < REFUSED_WITHIN_S, elapsed
    assert not (input_files / "run").exists()


def test_a_run_larger_than_the_host_is_refused_before_anything_is_allocated(tmp_path, capsys):
    started = time.monotonic()
    assert main(["train", "--model.seq_len", "100000", "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert "the attention scores of one step would take" in error
    assert "model.seq_len=100000" in error
    assert time.monotonic() - started < REFUSED_WITHIN_S


def test_the_xla_flags_follow_the_schedule_and_fp8():
    import scheduling.names
    from jaxmoe.parallel.host_devices import FP8_XLA_GPU_FLAGS, xla_flags_for

    def flags(*argv):
        return xla_flags_for(resolve_config(parse(["train", *argv])))

    assert flags() == []
    assert flags("--schedule", "lancet") == list(scheduling.names.XLA_GPU_FLAGS)
    assert flags("--model.fp8", "tensorwise") == ["--xla_gpu_enable_triton_gemm=false"]
    assert flags("--schedule", "lancet", "--model.fp8", "blockwise") == [
        *scheduling.names.XLA_GPU_FLAGS,
        *FP8_XLA_GPU_FLAGS,
    ]


def test_a_shortcut_and_its_field_may_repeat_the_same_value():
    config = config_from_train_args(
        ["--steps", "5", "--train.steps", "5", "--schedule", "dw", "--schedule.name", "dw"]
    )
    assert config.train.steps == 5 and config.schedule.name == "dw"
    config = config_from_train_args(
        ["--data", "a.txt", "b.bin:3", "--data.sources", "a.txt:1", "b.bin:3.0"]
    )
    assert config.data.sources == (DataSource("a.txt"), DataSource("b.bin", 3.0))


@pytest.mark.parametrize(
    ("argv", "flag", "guess"),
    [
        # Abbreviations argparse took for the whole flag (config would have printed them),
        # and misspellings; each case fails fast without the exact names.
        (["config", "--model.d_mode", "64"], "--model.d_mode", "--model.d_model"),
        (["config", "--train.zer", "2"], "--train.zer", "--train.zero"),
        (["config", "--parallel.pipe", "3"], "--parallel.pipe", "--parallel.pipeline"),
        (["config", "--moe.topk=2"], "--moe.topk", "--moe.top_k"),
        (["train", "--stpes", "3"], "--stpes", "--steps"),
        (["schedule", "--schedule.nmae", "dw"], "--schedule.nmae", "--schedule.name"),
        (["plan", "--devise", "3", "--profile", "a100"], "--devise", "--devices"),
        (["link-curves", "--out", "c.json", "--repaets", "2"], "--repaets", "--repeats"),
        (["data", "--input", "a.txt", "--out", "a.bin", "--eod", "x"], "--eod", "--eod-token"),
        (["convert", "--to-h", "x", "--out", "y"], "--to-h", "--to-hf"),
        (["generate", "--check", "x", "--prompt", "y"], "--check", "--checkpoint"),
        (["launch", "--num-procs", "2", "--", "train"], "--num-procs", "--num-processes"),
        (["launch", "-n", "2", "--", "train", "--train.zer", "2"], "--train.zer", "--train.zero"),
    ],
)
def test_flags_are_whole_names_and_an_unknown_one_names_the_closest(argv, flag, guess, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.endswith(f": error: unrecognized argument {flag}: did you mean {guess}?\n")
    assert error.count("\n") == 1, error


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_a_file_is_set_over_the_preset_and_flags_over_the_file(tmp_path):
    run = _write(tmp_path / "run.toml", "[moe]\ntop_k = 2\n[train]\nsteps = 7\nseed = 3\n")
    config = config_from_train_args(
        ["--preset", "mixtral-tiny", "--config", run, "--train.steps", "9"]
    )
    mixtral = preset("mixtral-tiny")
    assert config.model == mixtral.model and config.parallel == mixtral.parallel
    assert config.moe == dataclasses.replace(mixtral.moe, top_k=2)
    assert config.train == dataclasses.replace(mixtral.train, steps=9, seed=3)
    # A file alone is set over the defaults (a preset's file is such a file), not tiny.
    alone = config_from_train_args(["--config", run])
    assert alone == Config(moe=MoEConfig(top_k=2), train=TrainConfig(steps=7, seed=3))
    assert config_from_train_args([]) == preset("tiny")


def test_config_prints_every_field_as_a_file_that_repeats_the_configuration(tmp_path, capsys):
    flags = ["--preset", "qwen3_moe-tiny", "--moe.capacity_factor", "none", "--steps", "5"]
    assert main(["config", *flags]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"# jaxmoe config {' '.join(flags)}\n")
    assert 'capacity_factor = "none"' in printed and "op_cost_cache" not in printed
    repeated = config_from_train_args(["--config", _write(tmp_path / "q.toml", printed)])
    assert repeated == config_from_train_args(flags)


def test_the_commands_that_take_a_preset_take_a_file(tmp_path):
    run = _write(tmp_path / "run.toml", "[model]\nnum_layers = 2\n[parallel]\nexpert = 4\n")
    for command in ("schedule", "link-curves", "config"):
        args = parse([command, "--config", run, *(["--out", "x"] * (command == "link-curves"))])
        assert resolve_config(args).model.num_layers == 2
        assert resolve_config(args).parallel.expert == 4
    # The planner lays the model out itself: the file's layout is set aside.
    planned = resolve_config(parse(["plan", "--config", run, "--devices", "8", "--profile", "cpu"]))
    assert planned.model.num_layers == 2 and planned.parallel.expert == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "3", "--", "train"], "8 devices cannot be split evenly over 3 processes"),
        (["-n", "2", "--", "train", "--data", "{dir}/adir"], "adir' is a directory"),
        (["-n", "2", "--", "train", "--step-timeout", "-1"], "--step-timeout -1: must be"),
        (["-n", "2", "--", "train", "--steps", "1", "--train.steps", "2"], "disagree"),
    ],
)
def test_launch_refuses_before_spawning_anything(input_files, argv, message, capsys, monkeypatch):
    def spawn(*args, **kwargs):
        raise AssertionError("launch() was called")

    monkeypatch.setattr(launch_module, "launch", spawn)
    argv = [arg.format(dir=input_files) for arg in argv]
    assert main(["launch", *argv]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error


def test_refusals_are_quick_in_a_fresh_process(input_files):
    for argv in (
        ["train", CURVES, str(input_files / "empty.json")],
        ["launch", "-n", "3", "--", "train"],
    ):
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "jaxmoe.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - started
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and result.stdout == "", result.stderr
        assert elapsed < REFUSED_WITHIN_S, elapsed


def test_console_exit_status_in_a_fresh_process():
    result = subprocess.run(
        [sys.executable, "-m", "jaxmoe.cli", "train", "--moe.capacity_factor", "0"],
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
    # The one-layer model's own steps (tests of whole runs share them).
    flags = ["--steps", "3", *ONE_LAYER, "--train.eval_every", "2"]
    assert main(["train", *flags, "--out", str(out), "--no-progress"]) == 0
    config = json.loads((out / "config.json").read_text())
    # Unset fields are saved as nulls, and read back as unset.
    assert config["model"]["num_layers"] == 1 and config["moe"]["d_expert"] is None
    assert config["train"]["steps"] == 3
    # The saved configuration is a configuration file that repeats the run.
    repeated = config_from_train_args(["--config", str(out / "config.json")])
    assert repeated == config_from_train_args(flags)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for key in ("loss", "tokens_per_s", "dropped_fraction", "expert_imbalance", "aux_loss"):
        assert all(key in row for row in rows), key
    assert "val_loss" in rows[1] and "val_loss" in rows[2]
    assert "done: 3 steps" in capsys.readouterr().out
