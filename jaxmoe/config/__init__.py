"""The run's configuration: frozen, validated sections, read without importing JAX.

One module per section (model, moe, parallel, train, data, schedule) and
:class:`Config`, which holds them and checks what spans sections. Every invalid
value raises :class:`ConfigError` with one line naming the field and the fix.
"""

from jaxmoe.config.checks import ConfigError
from jaxmoe.config.config import Config
from jaxmoe.config.data import DataConfig, DataSource
from jaxmoe.config.model import ModelConfig
from jaxmoe.config.moe import MoEConfig, capacity_per_expert
from jaxmoe.config.parallel import ParallelConfig
from jaxmoe.config.schedule import ScheduleConfig
from jaxmoe.config.train import TrainConfig

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DataSource",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "ScheduleConfig",
    "TrainConfig",
    "capacity_per_expert",
]
