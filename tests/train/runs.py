"""A small configuration for tests that train whole runs, and what must match between runs."""

import dataclasses

from jaxmoe.config import Config, DataConfig
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


def with_schedule(config: Config, name: str | None = None, **fields) -> Config:
    """``config`` with its schedule section's ``name`` and any other ``fields`` replaced."""
    if name is not None:
        fields["name"] = name
    return dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, **fields))


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
