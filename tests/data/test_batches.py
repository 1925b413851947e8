"""The default corpus, custom data files, a split's windows, and batches that land sharded
on the mesh."""

import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxmoe.config import Config, ConfigError, DataConfig, DataSource, ModelConfig, ParallelConfig
from jaxmoe.data.batches import (
    TokenSplits,
    TokenWindows,
    load_tokens,
    put_on_mesh,
    stdlib_source_files,
)
from jaxmoe.data.mixture import corpus_batches, load_mixture
from jaxmoe.parallel.mesh import build_mesh


def test_default_corpus_is_the_standard_library_in_sorted_order():
    files = list(stdlib_source_files())
    assert len(files) > 100
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [f.relative_to(root).as_posix() for f in files]
    assert relative == sorted(relative)
    assert not any("site-packages" in f.parts for f in files)
    tokens = load_tokens(None, max_bytes=50_000)
    assert tokens.dtype == np.uint16 and len(tokens) == 50_000
    assert bytes(tokens[:2000].astype(np.uint8)) == files[0].read_bytes()[:2000]
    np.testing.assert_array_equal(tokens, load_tokens(None, max_bytes=50_000))


def test_text_and_bin_files(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world")
    np.testing.assert_array_equal(load_tokens(str(text)), list(b"hello world"))
    ids = np.array([1, 300, 65535, 7], dtype="<u2")
    binary = tmp_path / "ids.bin"
    ids.tofile(binary)
    np.testing.assert_array_equal(load_tokens(str(binary)), ids)


def test_the_bin_suffix_is_case_insensitive(tmp_path):
    ids = np.array([1, 300, 65535, 7], dtype="<u2")
    for name in ("ids.BIN", "ids.Bin"):
        ids.tofile(tmp_path / name)
        np.testing.assert_array_equal(load_tokens(str(tmp_path / name)), ids)
    (tmp_path / "odd.BIN").write_bytes(b"abc")
    with pytest.raises(ConfigError, match=r"even byte count"):
        load_tokens(str(tmp_path / "odd.BIN"))


def test_missing_file_directory_and_too_little_data(tmp_path):
    with pytest.raises(ConfigError, match=r"absent\.txt': no such file"):
        load_tokens(str(tmp_path / "absent.txt"))
    with pytest.raises(ConfigError, match=r"' is a directory; give a text file"):
        load_tokens(str(tmp_path))
    with pytest.raises(ConfigError, match=r"fewer than model\.seq_len"):
        TokenSplits(np.arange(100, dtype=np.uint16), 0.05, seq_len=64)


def test_a_corpus_with_ids_beyond_the_vocabulary_is_refused(tmp_path):
    path = tmp_path / "ids.bin"
    (np.arange(4000, dtype="<u2") % 600).tofile(path)
    data = DataConfig(sources=(DataSource(str(path)),))
    small = Config(model=ModelConfig(vocab_size=512), data=data)
    with pytest.raises(ConfigError, match=r"holds token id 599: use a vocabulary of at least 600"):
        load_mixture(small)
    (splits,) = load_mixture(Config(model=ModelConfig(vocab_size=600), data=data)).corpora
    assert splits.max_token_id == 599 and len(splits.train) + len(splits.val) == 4000


def test_splits_are_disjoint_head_and_tail():
    tokens = np.arange(1000, dtype=np.uint16)
    splits = TokenSplits(tokens, 0.1, seq_len=16)
    assert len(splits.train) == 900 and splits.val[0] == 900


def test_windows_take_each_token_as_an_input_once():
    windows = TokenWindows(np.arange(50, dtype=np.uint16), seq_len=8)
    assert len(windows) == 6  # (50 - 1) // 8: the last window's target is token 48
    np.testing.assert_array_equal(windows[0], np.arange(9))
    np.testing.assert_array_equal(windows[5], np.arange(40, 49))
    assert windows[5].dtype == np.int32


def test_batches_depend_only_on_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    sampler = corpus_batches(tokens, seq_len=8, global_batch=16, seed=3)
    rows = sampler.rows(5)
    assert rows.shape == (16, 9) and rows.dtype == np.int32
    np.testing.assert_array_equal(rows[:, 1:], rows[:, :-1] + 1)  # contiguous windows
    assert not np.any(rows[:, 0] % 8)  # at the stride of seq_len
    np.testing.assert_array_equal(rows, corpus_batches(tokens, 8, 16, seed=3).rows(5))
    np.testing.assert_array_equal(sampler.rows(5, first=4, count=4), rows[4:8])
    assert not np.array_equal(rows, sampler.rows(6))
    assert not np.array_equal(rows, corpus_batches(tokens, 8, 16, seed=4).rows(5))
    # A pass takes every window once, in an order of its own.
    windows = len(TokenWindows(tokens, 8))
    first = np.concatenate([sampler.rows(step)[:, 0] for step in range(windows // 16)])
    assert len(set(first.tolist())) == len(first)


def test_batch_lands_sharded_over_the_token_axes():
    mesh = build_mesh(ParallelConfig(data=2, expert=4))
    sampler = corpus_batches(np.arange(10_000, dtype=np.uint16), seq_len=8, global_batch=16)
    batch = put_on_mesh(sampler, 0, mesh)
    assert batch.shape == (16, 9)
    assert batch.sharding.spec == jax.sharding.PartitionSpec(("data", "expert"))
    shard_rows = {shard.device: shard.data.shape[0] for shard in batch.addressable_shards}
    assert set(shard_rows.values()) == {2} and len(shard_rows) == 8
    np.testing.assert_array_equal(np.asarray(batch), sampler.rows(0))


def test_rows_follow_the_mesh_whatever_its_device_order():
    devices = jax.devices()
    interleaved = devices[::2] + devices[1::2]
    mesh = build_mesh(ParallelConfig(data=2, expert=4), interleaved)
    sampler = corpus_batches(np.arange(10_000, dtype=np.uint16), 8, global_batch=16, seed=1)
    batch = put_on_mesh(sampler, 3, mesh)
    np.testing.assert_array_equal(np.asarray(batch), sampler.rows(3))
    for shard in batch.addressable_shards:
        np.testing.assert_array_equal(shard.data, sampler.rows(3)[shard.index])
