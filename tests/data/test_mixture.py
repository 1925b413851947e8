"""Corpora mixed by weight: the rows of every batch in the stated proportions, exactly,
for training and validation alike."""

import numpy as np
import pytest

from jaxmoe.config import Config, ConfigError, DataConfig, DataSource, ModelConfig, TrainConfig
from jaxmoe.data.mixture import load_mixture, run_batches

SEQ_LEN = 8


def two_corpora(tmp_path, weights=(3.0, 1.0)) -> Config:
    """Two corpora of ids told apart by their range (0..99 and 100..199), with ``weights``."""
    first, second = tmp_path / "low.bin", tmp_path / "high.bin"
    (np.arange(4000, dtype="<u2") % 100).tofile(first)
    (np.arange(4000, dtype="<u2") % 100 + 100).tofile(second)
    sources = (DataSource(str(first), weights[0]), DataSource(str(second), weights[1]))
    return Config(
        model=ModelConfig(seq_len=SEQ_LEN),
        train=TrainConfig(batch_size=8, seed=5),
        data=DataConfig(sources=sources),
    )


def from_second(rows: np.ndarray) -> np.ndarray:
    """Per row: drawn from the second corpus."""
    return rows.min(axis=-1) >= 100


def test_rows_are_drawn_in_the_weights_exactly(tmp_path):
    train, val = run_batches(config := two_corpora(tmp_path), load_mixture(config))
    for batches in (train, val):
        rows = np.stack([batches.rows(step) for step in range(10)])
        # 3 : 1 is 300 : 100 to Grain: every batch of 8 holds 6 rows of one and 2 of the other.
        np.testing.assert_array_equal(from_second(rows).sum(axis=1), [2] * 10)
    # Each corpus's rows are its own windows, in an order of its own.
    rows = np.concatenate([train.rows(step) for step in range(10)])
    starts = rows[~from_second(rows), 0]
    assert len(set(starts.tolist())) > 1 and not np.all(np.diff(starts) == SEQ_LEN)


def test_weights_that_are_not_integers_are_grains_integer_shares(tmp_path):
    config = two_corpora(tmp_path, weights=(0.7, 0.3))
    train, _ = run_batches(config, load_mixture(config))
    # 0.7 : 0.3 is 233 : 100 (the smallest weight scaled to 100): 233 of every 333 rows.
    rows = np.concatenate([train.rows(0, count=333), train.rows(0, first=333, count=333)])
    assert from_second(rows[:333]).sum() == from_second(rows[333:]).sum() == 100


def test_corpora_tokenized_differently_are_refused(tmp_path):
    config = two_corpora(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("plain text, read as bytes " * 200)
    low = config.data.sources[0]
    data = DataConfig(sources=(low, DataSource(str(text))))
    with pytest.raises(ConfigError, match=r"holds ids without a sidecar, but .*notes\.txt' holds"):
        load_mixture(Config(model=config.model, data=data))
