"""Make the Hugging Face fixtures of ``tests/hf``: tiny random Mixtral, Qwen2-MoE and
Qwen3-MoE models built with ``transformers``, their weights, config, token ids and logits.

Not run by CI, and not a dependency of the project: run it by hand, once, in a virtual
environment that has ``transformers`` and PyTorch (the CPU build is enough)::

    .venv/bin/pip install torch==2.13.0 transformers
    .venv/bin/python tools/make_hf_fixtures.py            # writes tests/fixtures/hf/<family>/

Each family's directory holds what ``save_pretrained`` writes for the model
(``model.safetensors``, ``config.json``; the generation config is dropped), and
``token_ids.npy`` (int32 ``[2, 16]``) with ``logits.npy`` (float32 ``[2, 16, vocab]``):
the Hugging Face forward pass of those ids, in float32 with eager attention; and
``greedy_ids.npy`` (int32 ``[2, 16]``): ``generate`` from the first 8 ids, 8 new tokens,
greedy, with no end-of-sequence id to stop early.

The models cover what the converter maps: grouped-query attention everywhere; Mixtral
stored in bfloat16 (its logits are those of the bfloat16 weights computed in float32),
the others in float32; Qwen2-MoE with query/key/value biases, a leading dense layer
(``mlp_only_layers``), the gated shared expert, ``norm_topk_prob`` false and tied
embeddings; Qwen3-MoE with its query/key norms, a head width of its own, YaRN rotary
scaling and ``norm_topk_prob`` true. The weights are drawn afresh with unit-scale
activations (``transformers`` initialises with a standard deviation of 0.02, which
leaves every router near uniform), and a seed is kept only if every token's k-th and
(k+1)-th expert probabilities differ by at least ``MIN_ROUTING_MARGIN``, so that no
rounding difference between the two implementations can change a routing decision.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "hf"
BATCH, SEQ, VOCAB = 2, 16, 256
MIN_ROUTING_MARGIN = 1e-3


def family_models() -> dict[str, tuple[transformers.PretrainedConfig, type, torch.dtype]]:
    """Each family's configuration, model class and the dtype its weights are saved in."""
    shared = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return {
        "mixtral": (
            MixtralConfig(
                **shared,
                intermediate_size=32,
                num_hidden_layers=2,
                num_local_experts=8,
                num_experts_per_tok=2,
                rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                tie_word_embeddings=False,
            ),
            MixtralForCausalLM,
            torch.bfloat16,
        ),
        "qwen2_moe": (
            Qwen2MoeConfig(
                **shared,
                intermediate_size=64,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=48,
                num_hidden_layers=3,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                mlp_only_layers=[0],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                tie_word_embeddings=True,
            ),
            Qwen2MoeForCausalLM,
            torch.float32,
        ),
        "qwen3_moe": (
            Qwen3MoeConfig(
                **shared,
                head_dim=16,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_hidden_layers=2,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
                tie_word_embeddings=False,
            ),
            Qwen3MoeForCausalLM,
            torch.float32,
        ),
    }


@torch.no_grad()
def randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Unit-scale random weights: matrices N(0, 1 / fan_in) (fan-in: the last axis, as
    torch lays out ``[out, in]``, the fused experts included), norm scales 1 + N(0, 0.2^2),
    biases N(0, 0.1^2)."""
    for name, parameter in model.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator)
        if parameter.ndim == 1 and "norm" in name:
            parameter.copy_(1 + 0.2 * noise)
        elif parameter.ndim == 1:
            parameter.copy_(0.1 * noise)
        else:
            parameter.copy_(noise / math.sqrt(parameter.shape[-1]))


def routing_margin(router_logits: tuple[torch.Tensor, ...], top_k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th expert probability."""
    margins = []
    for logits in router_logits:
        probabilities = torch.softmax(logits.float(), dim=-1)
        ranked = torch.sort(probabilities, dim=-1, descending=True).values
        margins.append(torch.min(ranked[:, top_k - 1] - ranked[:, top_k]).item())
    return min(margins)


PROMPT = 8  # ids the greedy continuation starts from


def make_family(name: str, out: Path, first_seed: int) -> None:
    config, model_class, dtype = family_models()[name]
    config._attn_implementation = "eager"
    ids = torch.from_numpy(np.random.default_rng(first_seed).integers(0, VOCAB, (BATCH, SEQ)))
    for seed in range(first_seed, first_seed + 100):
        torch.manual_seed(seed)
        model = model_class(config).eval()
        randomize(model, torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for parameter in model.parameters():  # the weights as they are stored
                parameter.copy_(parameter.to(dtype).float())
            output = model(ids, output_router_logits=True)
        margin = routing_margin(output.router_logits, config.num_experts_per_tok)
        if margin >= MIN_ROUTING_MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no seed gave a routing margin of {MIN_ROUTING_MARGIN}")
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    model.to(dtype).save_pretrained(target)
    (target / "generation_config.json").unlink(missing_ok=True)
    np.save(target / "token_ids.npy", ids.numpy().astype(np.int32))
    np.save(target / "logits.npy", output.logits.float().numpy())
    with torch.no_grad():
        prompt = ids[:, :PROMPT]
        greedy = model.float().generate(
            prompt,
            attention_mask=torch.ones_like(prompt),  # every id is a token, none padding
            max_new_tokens=SEQ - PROMPT,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    np.save(target / "greedy_ids.npy", greedy.numpy().astype(np.int32))
    saved = json.loads((target / "config.json").read_text())
    sizes = {path.name: path.stat().st_size for path in sorted(target.iterdir())}
    print(f"{name}: seed {seed}, routing margin {margin:.4f}, dtype {saved.get('dtype')}, {sizes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("families", nargs="*", default=list(family_models()))
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.families:
        make_family(name, args.out, args.seed)


if __name__ == "__main__":
    main()
