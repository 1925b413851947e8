"""Named configurations. ``tiny`` is the default: its loss visibly falls within a
couple of minutes on a 2-core CPU host with 8 fake devices."""

from __future__ import annotations

from jaxmoe.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)

PRESETS: dict[str, Config] = {
    "tiny": Config(
        model=ModelConfig(d_model=128, num_heads=4, num_layers=4, d_ff=512, seq_len=64),
        moe=MoEConfig(num_experts=8, top_k=1, capacity_factor=1.25),
        parallel=ParallelConfig(data=1, expert=8),
        train=TrainConfig(batch_size=32, steps=200, learning_rate=3e-3, warmup_steps=20),
    ),
    "small": Config(
        model=ModelConfig(d_model=128, num_heads=4, num_layers=6, d_ff=512, seq_len=128),
        moe=MoEConfig(num_experts=16, top_k=2, capacity_factor=1.25),
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=32, steps=500, learning_rate=2e-3, warmup_steps=50),
    ),
    # Lancet's GPT-2 MoE (12 layers, width 768, 16 heads, sequence 512, MoE every second
    # layer, top-1, capacity factor 1.0, experts = 2 x devices) on 8 devices. For the
    # scheduler and the simulator; far too large to train on a CPU host.
    "gpt2-moe-12": Config(
        model=ModelConfig(d_model=768, num_heads=16, num_layers=12, d_ff=3072, seq_len=512),
        moe=MoEConfig(num_experts=16, top_k=1, capacity_factor=1.0),
        parallel=ParallelConfig(data=1, expert=8),
        train=TrainConfig(batch_size=16, learning_rate=3e-4, warmup_steps=100),
        data=DataConfig(max_bytes=None),
    ),
}


def preset(name: str) -> Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown preset {name!r}: choose one of {', '.join(sorted(PRESETS))}"
        ) from None
