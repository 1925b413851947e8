"""The blockwise attention core, in tiles of 4 positions over sequences of 16 (4 query
tiles, 10 tile pairs: one ``lax.scan`` forward and one backward per layer), trains as the
dense reference core does, step for step, in each parallel layout: heads split over a
tensor group with sequence parallelism (grouped-query heads, rotary positions), a
pipeline of two stages over a folded layout, and fully sharded parameters (ZeRO-3) in
bfloat16.

Tolerances: float32 losses and gradient norms within 2e-5 relative, the same tokens
routed to each expert; bfloat16 losses within 1e-2 relative (the dense core rounds its
scores to bfloat16 before the softmax, the blockwise core accumulates them in float32).
"""

import numpy as np
import pytest

from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from tests.train.batches import train_steps

STEPS = 2
LLAMA = dict(
    norm="rmsnorm", position="rope", activation="swiglu", linear_bias=False, num_kv_heads=1,
    tie_embeddings=False,
)  # fmt: skip
# (parallel layout, model fields, train fields) of each layout.
LAYOUTS = {
    # One MoE layer: the cores are compared layer by layer, and a dense FFN adds none.
    "tensor2-sequence-gqa": (
        ParallelConfig(data=2, expert=4, tensor=2),
        dict(LLAMA, num_layers=1, moe_every=1),
        {},
    ),
    "pipeline2-folded": (
        ParallelConfig(data=1, expert=2, expert_tensor=2, tensor=2, pipeline=2),
        dict(num_layers=4, moe_every=1),
        dict(microbatches=2),
    ),
    "zero3-bf16": (ParallelConfig(data=2, expert=4), dict(dtype="bfloat16"), dict(zero=3)),
}


def config(layout: str, attention: str) -> Config:
    parallel, model_fields, train_fields = LAYOUTS[layout]
    model = {"num_layers": 2, "moe_every": 2, **model_fields}
    return Config(
        model=ModelConfig(
            d_model=32, num_heads=2, d_ff=64, seq_len=16, attention=attention,
            attention_block=4, **model,
        ),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        parallel=parallel,
        train=TrainConfig(batch_size=16, warmup_steps=1, learning_rate=1e-2, **train_fields),
    )  # fmt: skip


# Heads split over a tensor group by default; the pipeline and ZeRO-3 (two compiles each of
# steps other tests do not share) in the slow tier.
@pytest.mark.parametrize(
    "layout",
    [
        "tensor2-sequence-gqa",
        pytest.param("pipeline2-folded", marks=pytest.mark.slow),
        pytest.param("zero3-bf16", marks=pytest.mark.slow),
    ],
)
def test_blockwise_attention_trains_as_the_dense_core_in_every_layout(layout):
    dense, _ = train_steps(config(layout, "dense"), steps=STEPS)
    blockwise, _ = train_steps(config(layout, "blockwise"), steps=STEPS)

    bfloat16 = config(layout, "dense").model.dtype == "bfloat16"
    names = ("loss",) if bfloat16 else ("loss", "grad_norm", "aux_loss")
    for name in names:
        np.testing.assert_allclose(
            [m[name] for m in blockwise],
            [m[name] for m in dense],
            rtol=1e-2 if bfloat16 else 2e-5,
            err_msg=name,
        )
    if not bfloat16:
        np.testing.assert_array_equal(
            blockwise[-1]["tokens_per_expert"], dense[-1]["tokens_per_expert"]
        )
