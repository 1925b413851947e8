"""What the dropless evaluation compares (:mod:`experiments.dropless_eval`): the MoE
dispatch variants, the presets they run on, and the targets its results are read against.
"""

from __future__ import annotations

import dataclasses

PRESETS = ("mixtral-tiny", "deepseek_v3-tiny")
BASELINE = "capacity 1.25"
VARIANTS = {
    BASELINE: {"capacity_factor": 1.25},
    "padded dropless": {"capacity_factor": None, "dropless_dispatch": "padded"},
    "ragged dropless": {"capacity_factor": None, "dropless_dispatch": "ragged"},
    "ragged dropless, 2x buffer": {
        "capacity_factor": None,
        "dropless_dispatch": "ragged",
        "ragged_buffer_factor": 2.0,
    },
}
WARMUP = 2  # untimed rounds first
# Every variant starts from the same state, trained this many steps by the padded dropless
# step first (exact dropless routing): routing straight after initialisation is far more
# skewed than in training, and drops and loads are measured on the routing of a model
# that has begun to balance it.
WARM_VARIANT = "padded dropless"
SOCKET_HOSTS = 2
BYTES_TARGET = 1.1  # ragged dropless moves at most this times the bytes of capacity 1.25
PLACEMENT_TARGET = 0.5  # dynamic placement: at most this times static's excess load, drops


def variant_config(name: str, variant: str, steps: int = 100):
    from jaxmoe.presets import preset

    base = preset(name)
    moe = dataclasses.replace(base.moe, **VARIANTS[variant])
    train = dataclasses.replace(base.train, steps=steps, checkpoint_every=0, eval_every=steps)
    return dataclasses.replace(base, moe=moe, train=train)


def met(value: float, target: float) -> str:
    return "met" if value <= target else "missed"
