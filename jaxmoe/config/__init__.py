"""The run's configuration: frozen, validated sections, read without importing JAX."""

from jaxmoe.config.checks import ConfigError
from jaxmoe.config.config import (
    Config,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
    capacity_per_expert,
)

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "capacity_per_expert",
]
