"""A small configuration for tests that train whole runs, and what must match between runs."""

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np

from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import Config, DataConfig
from jaxmoe.data.batches import load_tokens
from jaxmoe.presets import preset

# Metrics that a resumed run reproduces exactly (times and throughput do not).
EXACT_KEYS = (
    "loss",
    "total_loss",
    "grad_norm",
    "learning_rate",
    "aux_loss",
    "z_loss",
    "dropped_fraction",
    "tokens_per_expert",
    "val_loss",
)


def linked(profile: str, link_mbit: float):
    """The profile named ``profile`` with a link of ``link_mbit`` Mbit/s per device (a slow
    link, for the scheduler to have all-to-all windows worth filling)."""
    import scheduling

    return scheduling.PROFILES[profile].with_link(link_mbit * 1e6 / 8)


def with_schedule(config: Config, name: str | None = None, **fields) -> Config:
    """``config`` with its schedule section's ``name`` and any other ``fields`` replaced."""
    if name is not None:
        fields["name"] = name
    return dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, **fields))


def default_corpus_head(max_bytes: int) -> tuple[str, str]:
    """``jaxmoe train`` flags for the first ``max_bytes`` bytes of the default corpus (the
    standard library's sources): in a test run, a text file of them, written once by the
    first process that asks in the run's directory of shared files (tests/conftest.py) and
    read as bytes, the same tokens without listing the standard library for every run
    (0.3 to 0.6 s); outside one, ``--data.max_bytes``."""
    files = os.environ.get("JAXMOE_TEST_FILES")
    if files is None:
        return ("--data.max_bytes", str(max_bytes))
    path = Path(files) / f"default-corpus-{max_bytes}.txt"
    if not path.exists():
        tokens = load_tokens(None, max_bytes)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_bytes(tokens.astype(np.uint8).tobytes())
        os.replace(partial, path)
    return ("--data", str(path))


# The tiny preset cut to one MoE layer of width 32 on sequences of 16 tokens, 8 a step, on
# the first 200 kB of the default corpus, as ``jaxmoe train`` flags: the model of the tests
# of whole runs whose claims are about the run (its processes, signals, checkpoints, files,
# metrics), not the model. Every such run of at most 22 steps compiles one step: the preset
# warms up over 20 steps and decays over max(steps - 1, warmup + 1) = 21 steps.
ONE_LAYER = (
    *("--model.num_layers", "1", "--model.moe_every", "1", "--model.seq_len", "16"),
    *("--train.batch_size", "8", "--model.d_model", "32", "--model.d_ff", "64"),
    *("--model.num_heads", "2", *default_corpus_head(200_000)),
)


def one_layer_config(**train_fields) -> Config:
    """:data:`ONE_LAYER` as a configuration (the tiny preset's training but for
    ``train_fields``)."""
    config = config_from_train_args(list(ONE_LAYER))
    return dataclasses.replace(config, train=dataclasses.replace(config.train, **train_fields))


def small_config(**train_fields) -> Config:
    """The ``tiny`` preset cut to 2 layers of width 64 on 300 kB of text: compiles in seconds."""
    tiny = preset("tiny")
    train = {"steps": 4, "eval_every": 1000, **train_fields}
    return dataclasses.replace(
        tiny,
        model=dataclasses.replace(tiny.model, num_layers=2, d_model=64),
        train=dataclasses.replace(tiny.train, **train),
        data=DataConfig(max_bytes=300_000),
    )


def assert_trained_close(actual, desired, *, rtol: float, atol: float, update: float):
    """Two trained states (or parameter trees) that differ by float rounding alone.

    AdamW turns a gradient ``g`` into an update of about ``lr * g / |g|``: where an element's
    gradient is itself round-off (it cancels), a few ulps of it move that element by up to
    an update, however close the rest is. So every floating-point element must be within
    ``update`` (absolute), and all but 0.1% of them within ``rtol``/``atol``; other leaves
    are compared exactly."""
    flat_actual, tree = jax.tree_util.tree_flatten_with_path(actual)
    flat_desired = tree.flatten_up_to(desired)
    for (path, a), b in zip(flat_actual, flat_desired, strict=True):
        name = jax.tree_util.keystr(path)
        a, b = np.asarray(a), np.asarray(b)
        if not np.issubdtype(a.dtype, np.floating):
            np.testing.assert_array_equal(a, b, err_msg=name)
            continue
        np.testing.assert_allclose(a, b, rtol=0, atol=update, err_msg=name)
        off = ~np.isclose(a, b, rtol=rtol, atol=atol)
        assert off.mean() <= 1e-3, f"{name}: {off.sum()} of {off.size} elements off"
