"""jaxmoe: Mixture-of-Experts transformers in JAX, expert-parallel over a device mesh."""

from jaxmoe.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
]
__version__ = "0.1.0"
