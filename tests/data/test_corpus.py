"""``jaxmoe data`` end to end, the corpus files it writes, and the loader that reads them."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxmoe.cli.data_command import unescape
from jaxmoe.cli.main import main
from jaxmoe.config import Config, ConfigError, DataConfig, DataSource, ModelConfig
from jaxmoe.data import sources
from jaxmoe.data.batches import load_corpus
from jaxmoe.data.corpus import corpus_eod_id, corpus_tokenizer, read_info
from jaxmoe.data.mixture import corpus_batches, load_mixture

STORIES = [f"story {i}: the fox jumped {i} times over the lazy dog." for i in range(40)]


def _data(*argv) -> int:
    return main(["data", "--no-progress", *map(str, argv)])


def _one_line_error(capsys, pattern: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxmoe data: error: "), err
    assert pattern in err, err


def _documents(path, info) -> list[list[int]]:
    """The corpus's documents, split at (and without) its end-of-document ids."""
    ids = np.fromfile(path, dtype=info.numpy_dtype)
    assert ids[-1] == info.eod_id
    ends = np.flatnonzero(ids == info.eod_id)
    return [ids[a + 1 : b].tolist() for a, b in zip([-1, *ends[:-1]], ends, strict=True)]


def _texts(tmp_path):
    (tmp_path / "one.txt").write_text("A whole file is one document.\n\nEven with blank lines.\n")
    (tmp_path / "many.txt").write_text(
        "first part<|endoftext|>\nsecond part\n<|endoftext|>third part"
    )
    with (tmp_path / "lines.jsonl").open("w") as f:
        for i, story in enumerate(STORIES):
            f.write(json.dumps({"id": i, "body": story}) + "\n")
        f.write("\n")  # a blank line is skipped
    return tmp_path / "one.txt", tmp_path / "lines.jsonl"


def test_a_trained_tokenizer_corpus_in_uint16_read_back_by_the_loader(tmp_path, capsys):
    one, lines = _texts(tmp_path)
    out = tmp_path / "corpus" / "web.bin"
    assert (
        _data("--input", one, lines, "--text-field", "body", "--out", out, "--train-tokenizer", 300)
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    info = read_info(out, "test")
    assert info.dtype == "uint16" and info.vocab_size == 300 and info.eod_id == 0
    assert info.documents == 1 + len(STORIES) and info.tokens == out.stat().st_size // 2
    assert json.loads(out.with_suffix(".json").read_text())["format"] == "jaxmoe.corpus"
    tokenizer = Tokenizer.from_file(str(corpus_tokenizer(out, info)))
    decoded = [tokenizer.decode(doc) for doc in _documents(out, info)]
    assert decoded == [one.read_text(), *STORIES]

    config = Config(
        model=ModelConfig(vocab_size=300, seq_len=16),
        data=DataConfig(sources=(DataSource(str(out)),)),
    )
    (splits,) = load_mixture(config).corpora
    assert splits.eod_id == 0 == corpus_eod_id(str(out))
    assert isinstance(load_corpus(str(out)).tokens, np.memmap)
    assert len(splits.train) + len(splits.val) == info.tokens
    with pytest.raises(
        ConfigError,
        match=r"^model\.vocab_size=256, .* has 300 tokens: use "
        r"--model\.vocab_size 300 or more$",
    ):
        load_mixture(Config(model=ModelConfig(vocab_size=256, seq_len=16), data=config.data))

    # The same tokenizer, given: the same ids; a .txt split at a separator.
    again = tmp_path / "again.bin"
    many = tmp_path / "many.txt"
    assert (
        _data(
            "--input",
            tmp_path,
            "--text-field",
            "body",
            "--out",
            again,
            "--tokenizer",
            corpus_tokenizer(out, info),
        )
        == 0
    )
    again_info = read_info(again, "test")
    assert again_info.documents == 1 + 1 + len(STORIES)  # many.txt: one document
    # The directory's files in sorted order: lines.jsonl, many.txt, one.txt.
    again_documents, documents = _documents(again, again_info), _documents(out, info)
    assert again_documents[: len(STORIES)] == documents[1:]
    assert again_documents[-1] == documents[0]
    split = tmp_path / "split.bin"
    assert (
        _data(
            "--input",
            many,
            "--txt-separator",
            "<|endoftext|>",
            "--out",
            split,
            "--tokenizer",
            corpus_tokenizer(out, info),
        )
        == 0
    )
    split_info = read_info(split, "test")
    texts = [tokenizer.decode(doc) for doc in _documents(split, split_info)]
    assert texts == ["first part", "second part", "third part"]
    assert unescape(r"a\n\tb\\n") == "a\n\tb\\n"


def test_parquet_input(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"content": [*STORIES, None, ""], "n": list(range(len(STORIES) + 2))})
    pq.write_table(table, tmp_path / "stories.parquet", row_group_size=7)
    out = tmp_path / "p.bin"
    assert (
        _data(
            "--input",
            tmp_path / "stories.parquet",
            "--text-field",
            "content",
            "--out",
            out,
            "--train-tokenizer",
            280,
        )
        == 0
    )
    info = read_info(out, "test")
    tokenizer = Tokenizer.from_file(str(corpus_tokenizer(out, info)))
    assert [tokenizer.decode(d) for d in _documents(out, info)] == STORIES  # nulls skipped


def _wide_tokenizer(tmp_path, size: int = 70_000):
    """A word-level tokenizer of ``size`` tokens: ids above 65,535 need uint32."""
    vocab = {"[UNK]": 0, "<|endoftext|>": 1} | {f"w{i}": i for i in range(2, size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    path = tmp_path / f"wide{size}.tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_a_vocabulary_beyond_uint16_is_written_and_read_as_uint32(tmp_path, capsys):
    lines = tmp_path / "docs.jsonl"
    words = [[f"w{(i * 7919 + j * 104729) % 69_998 + 2}" for j in range(30)] for i in range(20)]
    lines.write_text("".join(json.dumps({"text": " ".join(w)}) + "\n" for w in words))
    out = tmp_path / "wide.bin"
    assert _data("--input", lines, "--out", out, "--tokenizer", _wide_tokenizer(tmp_path)) == 0
    info = read_info(out, "test")
    assert (info.dtype, info.vocab_size, info.eod_id, info.tokens) == ("uint32", 70_000, 1, 620)
    assert _documents(out, info) == [[int(w[1:]) for w in doc] for doc in words]

    data = DataConfig(sources=(DataSource(str(out)),))
    mixture = load_mixture(Config(model=ModelConfig(vocab_size=70_000, seq_len=16), data=data))
    (splits,) = mixture.corpora
    assert splits.train.dtype == np.dtype("<u4") and splits.max_token_id > 65_535
    rows = corpus_batches(splits.train, seq_len=16, global_batch=8).rows(3)
    whole = np.asarray(splits.train)
    windows = {tuple(whole[i * 16 : i * 16 + 17]) for i in range((len(whole) - 1) // 16)}
    assert all(tuple(row) in windows for row in rows.tolist())
    assert rows.dtype == np.int32 and rows.max() > 65_535

    # jaxmoe train refuses it before anything compiles, in one line naming the field.
    flags = ["--model.vocab_size", "65536", "--model.seq_len", "16", "--steps", "1"]
    status = main(["train", "--data", str(out), *flags])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "model.vocab_size=65536" in err and "--model.vocab_size 70000 or more" in err


def test_bad_inputs_are_refused_in_one_line(tmp_path, capsys):
    one, lines = _texts(tmp_path)
    (tmp_path / "table.csv").write_text("text\nhello\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    notes = tmp_path / "notes.json"
    notes.write_text('{"text": "JSON lines in a .json file"}\n')
    out = tmp_path / "out.bin"
    tok = ("--train-tokenizer", 300)
    cases = [
        (("--input", tmp_path / "absent.txt", "--out", out, *tok), "absent.txt: no such file"),
        (("--input", tmp_path / "table.csv", "--out", out, *tok), "unknown kind of file"),
        (
            ("--input", lines, "--out", out, *tok),
            "no 'text' field; name the text field with --text-field (fields: id, body)",
        ),
        (("--input", tmp_path / "bad.jsonl", "--out", out, *tok), "line 2: field 'text' is a int"),
        (("--input", one, "--out", tmp_path / "out.txt", *tok), "must end in .bin"),
        (("--input", notes, "--out", tmp_path / "notes.bin", *tok), "would overwrite the input"),
        (("--input", one, "--out", out, "--train-tokenizer", 100), "at least 257"),
        (
            ("--input", one, "--out", one / "sub" / "o.bin", *tok),
            f"--out {one / 'sub' / 'o.bin'}: cannot write in {one / 'sub'} (not a directory): "
            "choose a folder you can write",
        ),
        (
            ("--input", one, "--out", out, *tok, "--eod-token", ""),
            "--eod-token '': the end-of-document token needs a text of its own",
        ),
        (("--input", one, "--out", out, "--tokenizer", tmp_path / "none.json"), "no such file"),
        (("--input", one, "--out", out, "--tokenizer", one), "not a tokenizers file"),
        (
            (
                "--input",
                one,
                "--out",
                out,
                "--tokenizer",
                _wide_tokenizer(tmp_path, 10),
                "--eod-token",
                "</s>",
            ),
            "'</s>': not in the tokenizer's vocabulary; give one of its "
            "special tokens: <|endoftext|>",
        ),
    ]
    for argv, message in cases:
        assert _data(*argv) == 2, message
        _one_line_error(capsys, message)
        assert not out.exists()
    (tmp_path / "empty.txt").write_text("")
    assert _data("--input", tmp_path / "empty.txt", "--out", out, *tok) == 2
    _one_line_error(capsys, "no document")
    assert not out.exists() and not (tmp_path / "out.bin.partial").exists()
    assert _data("--input", one, "--out", out, *tok) == 0
    assert _data("--input", one, "--out", out, *tok) == 2
    _one_line_error(capsys, "out.bin, out.json, out.tokenizer.json already exist; give --overwrite")
    assert _data("--input", one, "--out", out, *tok, "--overwrite") == 0
    # A tokenizer named like the sidecar would be: refused, even with --overwrite.
    (tmp_path / "out.json").rename(tmp_path / "kept.json")
    (tmp_path / "out.tokenizer.json").rename(tmp_path / "out.json")
    assert (
        _data("--input", one, "--out", out, "--tokenizer", tmp_path / "out.json", "--overwrite")
        == 2
    )
    _one_line_error(capsys, "would overwrite the input")


def test_parquet_without_the_column(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "t.parquet")
    assert (
        _data(
            "--input", tmp_path / "t.parquet", "--out", tmp_path / "o.bin", "--train-tokenizer", 300
        )
        == 2
    )
    _one_line_error(
        capsys, "no column 'text'; name the text column with --text-field (columns: body, n)"
    )
    assert (
        _data(
            "--input",
            tmp_path / "t.parquet",
            "--text-field",
            "n",
            "--out",
            tmp_path / "o.bin",
            "--train-tokenizer",
            300,
        )
        == 2
    )
    _one_line_error(capsys, "column 'n' holds int64, not text")


def test_document_masks_need_an_end_of_document_id(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.mask_across_documents=True: the default"):
        DataConfig(mask_across_documents=True)
    (tmp_path / "plain.txt").write_text("x" * 500)
    np.arange(500, dtype="<u2").tofile(tmp_path / "ids.bin")
    for name in ("plain.txt", "ids.bin"):
        data = DataConfig(sources=(DataSource(str(tmp_path / name)),), mask_across_documents=True)
        with pytest.raises(ConfigError, match=r"has no end-of-document id .*jaxmoe data"):
            load_mixture(Config(model=ModelConfig(vocab_size=512, seq_len=16), data=data))
    assert corpus_eod_id(str(tmp_path / "ids.bin")) is None and corpus_eod_id(None) is None


def test_sidecars_that_do_not_match_are_refused(tmp_path):
    path = tmp_path / "c.bin"
    (np.arange(1000, dtype="<u2") % 100).tofile(path)
    sidecar = {
        "format": "jaxmoe.corpus",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": 100,
        "eod_id": 0,
        "eod_token": "<|endoftext|>",
        "tokenizer": None,
        "documents": 1,
        "tokens": 1000,
    }
    config = Config(
        model=ModelConfig(vocab_size=128, seq_len=16),
        data=DataConfig(sources=(DataSource(str(path)),)),
    )
    (tmp_path / "c.json").write_text(json.dumps(sidecar))
    assert load_mixture(config).eod_id == 0
    for change, message in [
        ({"tokens": 999}, r"2000 bytes, but c\.json says 999 uint16 tokens"),
        ({"dtype": "uint32"}, r"2000 bytes, but c\.json says 1000 uint32 tokens \(4000 bytes\)"),
        ({"dtype": "int8"}, r"dtype 'int8'"),
        ({"format": "other"}, r"c\.json is not a valid sidecar \(not a corpus sidecar"),
        ({"eod_id": 100}, r"eod_id 100: must be an id below vocab_size"),
    ]:
        (tmp_path / "c.json").write_text(json.dumps(sidecar | change))
        with pytest.raises(ConfigError, match=message):
            load_mixture(config)
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"c\.json is not a valid sidecar"):
        load_mixture(config)


def test_text_files_split_at_a_separator_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BLOCK_BYTES", 7)  # separators and characters straddle blocks
    rng = np.random.default_rng(0)
    alphabet = list("ab x\né€<|e>")
    for trial in range(100):
        separator = ["<|e|>", "\n\n", "x", "é€"][trial % 4]
        parts = ["".join(rng.choice(alphabet, size=rng.integers(0, 12))) for _ in range(5)]
        text = separator.join(parts)
        path = tmp_path / f"{trial}.txt"
        path.write_text(text)
        split = list(sources._text_documents(path, separator, lambda _: None))
        assert split == [part.strip() for part in text.split(separator)]
        assert list(sources._text_documents(path, None, lambda _: None)) == [text]
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    with pytest.raises(ConfigError, match=r"latin1\.txt: not UTF-8 text \(near byte 3\)"):
        list(sources.documents(tmp_path / "latin1.txt"))
