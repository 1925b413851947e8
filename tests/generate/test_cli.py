"""``jaxmoe generate``: a run directory's checkpoint, its tokenizer, the continuation
printed, and one-line refusals with status 2."""

import dataclasses
import json
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from jaxmoe.cli.main import main
from jaxmoe.config import ConfigError, DataConfig, DataSource
from jaxmoe.generate import Decoder, load_run_model, run_codec
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.presets import preset
from jaxmoe.train.checkpoint import RunCheckpoints
from jaxmoe.train.resolved import resolve
from jaxmoe.train.state import init_train_state

PROMPT = "def main("


def _config():
    """``tiny`` cut to 2 layers of width 64, as trained on 8 devices (expert = 8)."""
    tiny = preset("tiny")
    return dataclasses.replace(
        tiny, model=dataclasses.replace(tiny.model, num_layers=2, d_model=64)
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with the checkpoints of steps 0 and 1 (another seed's parameters)."""
    out = tmp_path_factory.mktemp("run")
    config = _config()
    mesh = build_mesh(config.parallel)
    with RunCheckpoints(out, resolve(config)) as checkpoints:
        checkpoints.save(init_train_state(resolve(config, mesh)))
        later = dataclasses.replace(config, train=dataclasses.replace(config.train, seed=1))
        state = init_train_state(resolve(later, mesh))
        checkpoints.save(state._replace(step=state.step + 1))
        checkpoints.wait()
    return out, jax.device_get(state.params)


def _generate(capsys, *argv):
    status = main(["generate", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_newest_checkpoint_is_read_onto_one_device(run_dir):
    out, params = run_dir
    loaded = load_run_model(out)
    assert loaded.step == 1
    assert loaded.config == _config()
    restored = nnx.to_pure_dict(nnx.state(loaded.model, nnx.Param))
    chex.assert_trees_all_equal(jax.device_get(restored), params)
    (device,) = {leaf.device for leaf in jax.tree.leaves(restored)}
    assert device == jax.devices()[0]


def test_generate_prints_the_greedy_continuation(run_dir, capsys):
    out, _ = run_dir
    status, printed, error = _generate(
        capsys, "--checkpoint", str(out), "--prompt", PROMPT, "--max-new-tokens", "8"
    )
    assert status == 0, error
    loaded = load_run_model(out)
    codec = run_codec(out, loaded.config)
    assert codec.tokenizer is None  # the default corpus: bytes
    (expected,) = Decoder(loaded.model).generate([list(PROMPT.encode())], 8)
    assert printed == codec.decode(expected) + "\n"

    status, sampled, _ = _generate(
        capsys, "--checkpoint", str(out), "--prompt", PROMPT, "--max-new-tokens", "8",
        "--temperature", "1.0", "--top-k", "1",
    )  # fmt: skip
    assert status == 0
    assert sampled == printed


def test_an_unreadable_newest_checkpoint_is_passed_over_and_left_as_it_is(
    run_dir, tmp_path, capsys
):
    out, _ = run_dir
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    (copy / "checkpoints" / "1" / "state" / "_METADATA").unlink()
    assert load_run_model(copy).step == 0
    assert "the checkpoint of step 1 cannot be read" in capsys.readouterr().err
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["0", "1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "-0.5"], "--temperature -0.5: must be >= 0"),
        (["--top-k", "-1"], "--top-k -1: must be an integer >= 0"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
        (["--prompt", "x" * 65], "--prompt: 65 tokens, longer than the model's model.seq_len=64"),
        (["--checkpoint", "MISSING"], "no such directory"),
        (["--checkpoint", "EMPTY"], "holds no checkpoint"),
        (["--checkpoint", "BROKEN"], "no checkpoint can be read: step 0"),
        (
            ["--checkpoint", "GARBLED"],
            "no checkpoint can be read: step 0 (a file of it is not valid JSON: Expecting "
            "value: line 1 column 1 (char 0)); give a run directory whose checkpoints are intact",
        ),
        (["--checkpoint", "A_FILE"], "is a file, not a run directory: give the run it is in"),
        (
            ["--speculative", "mtp"],
            "--speculative mtp: the model has no multi-token prediction module",
        ),
        (
            ["--speculative", "mtp", "--temperature", "0.5"],
            "--speculative mtp with --temperature 0.5: speculative decoding is greedy here",
        ),
    ],
)
def test_bad_input_is_one_line_and_status_2(run_dir, tmp_path, capsys, argv, message):
    out, _ = run_dir
    (tmp_path / "EMPTY").mkdir()
    broken = tmp_path / "BROKEN" / "checkpoints" / "0"
    shutil.copytree(out / "checkpoints" / "0", broken)
    shutil.rmtree(broken / "state")
    garbled = tmp_path / "GARBLED" / "checkpoints" / "0"
    shutil.copytree(out / "checkpoints" / "0", garbled)
    (garbled / "state" / "_METADATA").write_text("garbage{")
    a_run = tmp_path / "run"  # a run directory, and a file in it
    (a_run / "checkpoints").mkdir(parents=True)
    (a_run / "config.json").write_text("{}")
    paths = {name: tmp_path / name for name in ("MISSING", "EMPTY", "BROKEN", "GARBLED")}
    paths["A_FILE"] = a_run / "config.json"
    argv = [str(paths[a]) if a in paths else a for a in argv]
    defaults = {"--checkpoint": str(out), "--prompt": PROMPT}
    for flag, value in defaults.items():
        if flag not in argv:
            argv += [flag, value]
    status, printed, error = _generate(capsys, *argv)
    assert status == 2
    assert printed == ""
    assert message in error
    assert error.count("\n") == 1, error


def _word_tokenizer(path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def test_a_converted_models_tokenizer_and_its_end_of_document_id(run_dir, tmp_path, capsys):
    out, _ = run_dir
    copy = tmp_path / "converted"
    shutil.copytree(out, copy)
    kept = copy / "hf"  # where jaxmoe convert keeps the model's tokenizer files
    kept.mkdir()
    loaded = load_run_model(copy)
    with pytest.raises(ConfigError, match=r"a converted model without hf/tokenizer\.json"):
        run_codec(copy, loaded.config)
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(254)]
    _word_tokenizer(kept / "tokenizer.json", words)
    codec = run_codec(copy, loaded.config)
    assert codec.stop_ids == ()
    prompt = codec.encode("w3 w7 w9")
    assert prompt == [5, 9, 11]
    (greedy,) = Decoder(loaded.model).generate([prompt], 6)

    argv = ["--checkpoint", str(copy), "--prompt", "w3 w7 w9", "--max-new-tokens", "6"]
    status, printed, _ = _generate(capsys, *argv)
    assert status == 0
    assert printed.split() == [words[i] for i in greedy if i > 1]

    # The first greedy token as the end-of-document token: nothing is printed.
    (kept / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[0]]}))
    assert run_codec(copy, loaded.config).stop_ids == (greedy[0],)
    status, printed, _ = _generate(capsys, *argv)
    assert (status, printed) == (0, "\n")
    (kept / "generation_config.json").unlink()
    (kept / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))
    assert run_codec(copy, loaded.config).stop_ids == (1,)
    # DIR/tokenizer.json comes first.
    _word_tokenizer(copy / "tokenizer.json", ["<unk>", "a"])
    assert run_codec(copy, loaded.config).encode("a") == [1]


def test_the_tokenizer_of_the_runs_corpus(tmp_path):
    from jaxmoe.data.corpus import CorpusInfo, write_info

    corpus = tmp_path / "web.bin"
    np.zeros(4, "<u2").tofile(corpus)
    config = dataclasses.replace(_config(), data=DataConfig(sources=(DataSource(str(corpus)),)))
    with pytest.raises(ConfigError, match=r"has no sidecar web\.json here"):
        run_codec(tmp_path / "run", config)
    _word_tokenizer(tmp_path / "web.tokenizer.json", ["<unk>", "<|endoftext|>", "a"])
    info = CorpusInfo("uint16", 3, 1, "<|endoftext|>", "web.tokenizer.json", 1, 4)
    write_info(corpus, info)
    codec = run_codec(tmp_path / "run", config)
    assert codec.stop_ids == (1,)
    assert codec.encode("a a") == [2, 2]
    assert codec.source == str(tmp_path / "web.tokenizer.json")
