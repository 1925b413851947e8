"""The presets: named configurations, each a configuration file of this package.

``NAME.toml`` here is the preset ``NAME``: the GPT-2 family's (``tiny``, the default,
``small``, ``gpt2-moe-12``) and the model families people train today (Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 style), each as a ``-tiny`` shape that trains on 8
fake CPU devices and the published full shapes for the planner, their sources in the
files' comments. A preset is read as any configuration file is
(:mod:`jaxmoe.config.files`) over the defaults, so a copy of one, edited, is a
``--config`` file; ``jaxmoe config --preset NAME`` prints one with every field.
"""

from __future__ import annotations

import functools
from importlib import resources
from importlib.resources.abc import Traversable

from jaxmoe.config import Config, ConfigError
from jaxmoe.config.files import read_config_file

_FILES = resources.files(__name__)
_SUFFIX = ".toml"

# The presets' names, sorted.
PRESETS: tuple[str, ...] = tuple(
    sorted(
        entry.name.removesuffix(_SUFFIX)
        for entry in _FILES.iterdir()
        if entry.name.endswith(_SUFFIX)
    )
)


def preset_file(name: str) -> Traversable:
    """The file of the preset ``name``, in the installed package."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return _FILES / f"{name}{_SUFFIX}"


@functools.cache
def preset(name: str) -> Config:
    """The configuration of the preset ``name``; ConfigError naming the presets for any
    other name."""
    with resources.as_file(preset_file(name)) as path:
        return Config.from_dict(read_config_file(path))
