"""Make the Hugging Face fixtures of ``tests/hf``: tiny random Mixtral, Qwen2-MoE,
Qwen3-MoE and DeepSeek-V3 models built with ``transformers``, their weights, config, token
ids and logits.

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
scaling and ``norm_topk_prob`` true; DeepSeek-V3 with multi-head latent attention (a
query rank, a value width apart from the keys', rotary features stored interleaved, YaRN
with ``mscale`` and ``mscale_all_dim``), a leading dense layer, the sigmoid router with
its selection bias (float32, as DeepSeek's checkpoints keep it) and expert groups, a
shared expert, and one multi-token prediction module stored as the layer after the last,
as DeepSeek's checkpoints store it (transformers' ``MtpLayer``, whose logits for the
token two places ahead are ``mtp_logits.npy``, ``[2, 15, vocab]``: the last position has
no next token), in bfloat16. ``deepseek_v3_fp8`` is the same model with its linear layers
stored as block-scaled FP8 (``weight_scale_inv``, blocks of 16 x 16, some partial), its
logits those of the FP8 weights widened to float32. The weights are drawn afresh with unit-scale
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
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3TopkRouter,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "hf"
BATCH, SEQ, VOCAB = 2, 16, 256
MIN_ROUTING_MARGIN = 1e-3
FP8_BLOCK = (16, 16)
E4M3_MAX = 448.0


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
        "deepseek_v3": (
            DeepseekV3Config(
                **{**shared, "num_key_value_heads": 4},
                intermediate_size=64,
                moe_intermediate_size=16,
                num_hidden_layers=3,
                first_k_dense_replace=1,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_group=4,
                topk_group=2,
                n_shared_experts=1,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=12,
                rope_interleave=True,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                    "mscale": 0.707,
                    "mscale_all_dim": 1.0,
                    "beta_fast": 32,
                    "beta_slow": 1,
                },
                num_mtp_layers=1,
                tie_word_embeddings=False,
            ),
            DeepseekV3ForCausalLM,
            torch.bfloat16,
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


def gap(values: torch.Tensor, rank: int) -> float:
    """The smallest gap between a row's ``rank``-th and ``rank + 1``-th largest value."""
    ranked = torch.sort(values, dim=-1, descending=True).values
    return torch.min(ranked[:, rank - 1] - ranked[:, rank]).item()


def grouped_routing_margin(router: DeepseekV3TopkRouter, logits: torch.Tensor) -> float:
    """DeepSeek-V3's choice: the smallest gap at the chosen groups' edge (group scores:
    the sum of a group's two best biased scores) and at the top-k's edge among them."""
    choice = torch.sigmoid(logits.float()) + router.e_score_correction_bias.float()
    grouped = choice.view(-1, router.num_group, router.num_experts // router.num_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    margins = (
        [] if router.topk_group == router.num_group else [gap(group_scores, router.topk_group)]
    )
    chosen = group_scores.topk(router.topk_group, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    allowed = allowed[:, :, None].expand_as(grouped).reshape(choice.shape)
    margins.append(gap(choice.masked_fill(~allowed, -1e9), router.top_k))
    return min(margins)


def capture_routers(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """Every DeepSeek router's logits of the next forward pass, as (router, logits)."""
    seen: list[tuple[torch.nn.Module, torch.Tensor]] = []
    for root in modules:
        for module in root.modules():
            if isinstance(module, DeepseekV3TopkRouter):
                module.register_forward_hook(
                    lambda router, _, output: seen.append((router, output[0].detach()))
                )
    return seen


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 as DeepSeek stores it: per block, scale = amax / 448 (float32),
    values = weight / scale in float8_e4m3fn; the weight is values x scale."""
    rows, columns = weight.shape
    blocks_r, blocks_c = -(-rows // block[0]), -(-columns // block[1])
    padded = torch.zeros(blocks_r * block[0], blocks_c * block[1])
    padded[:rows, :columns] = weight.float()
    tiles = padded.view(blocks_r, block[0], blocks_c, block[1])
    scale = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).float()
    values = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return values.view(padded.shape)[:rows, :columns].contiguous(), scale


def dequantize_fp8(
    values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    spread = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return values.float() * spread[: values.shape[0], : values.shape[1]]


def fp8_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The tensors an FP8 DeepSeek checkpoint stores in FP8: the linear layers' weights in
    the decoder and MTP layers, not the routers' nor the copies of the embedding and head."""
    return (
        name.startswith("model.layers.")
        and tensor.ndim == 2
        and not name.endswith(("mlp.gate.weight", "embed_tokens.weight", "shared_head.head.weight"))
    )


def mtp_tensors(layer: MtpLayer, index: int, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The MTP module as DeepSeek's checkpoint stores it: layer ``index`` holding the
    block's tensors, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies
    of the embedding and head."""
    prefix = f"model.layers.{index}."
    tensors = {}
    for name, tensor in layer.state_dict().items():
        name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):  # transformers' fused experts, one each
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e]
        else:
            tensors[prefix + name] = tensor
    tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach()
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight.detach()
    return tensors


@torch.no_grad()
def mtp_logits(layer: MtpLayer, model: torch.nn.Module, ids: torch.Tensor, hidden: torch.Tensor):
    """The MTP module's logits at positions 0 .. SEQ - 2: the final-norm hidden state of
    position i and the embedding of token i + 1, predicting token i + 2."""
    embedded = model.model.embed_tokens(ids[:, 1:])
    length = embedded.shape[1]
    positions = torch.arange(length)[None].expand(ids.shape[0], -1)
    rotary = model.model.rotary_emb(embedded, positions)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    out = layer(embedded, hidden[:, :-1], rotary, causal, positions, None)
    return model.lm_head(out)


PROMPT = 8  # ids the greedy continuation starts from


def make_deepseek(out: Path, first_seed: int) -> None:
    """``deepseek_v3`` (bfloat16, its MTP layer after the last) and ``deepseek_v3_fp8``."""
    name = "deepseek_v3"
    config, model_class, dtype = family_models()[name]
    config._attn_implementation = "eager"
    ids = torch.from_numpy(np.random.default_rng(first_seed).integers(0, VOCAB, (BATCH, SEQ)))
    layers = config.num_hidden_layers
    for seed in range(first_seed, first_seed + 200):
        torch.manual_seed(seed)
        model = model_class(config).eval()
        layer = MtpLayer(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, layers).eval()
        generator = torch.Generator().manual_seed(seed)
        randomize(model, generator)
        randomize(layer, generator)
        with torch.no_grad():
            for module in (model, layer):
                for parameter in module.parameters():  # the weights as they are stored
                    parameter.copy_(parameter.to(dtype).float())
                for sub in module.modules():
                    if isinstance(sub, DeepseekV3TopkRouter):  # float32 in the checkpoint
                        sub.e_score_correction_bias.copy_(
                            0.1 * torch.randn(sub.num_experts, generator=generator)
                        )
        seen = capture_routers([model, layer])
        with torch.no_grad():
            output = model(ids, output_hidden_states=True)
            ahead = mtp_logits(layer, model, ids, output.hidden_states[-1])
        margin = min(grouped_routing_margin(router, logits) for router, logits in seen)
        if margin >= MIN_ROUTING_MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no seed gave a routing margin of {MIN_ROUTING_MARGIN}")
    target = out / name
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target)  # float32, every value a bfloat16 one but the biases
    (target / "generation_config.json").unlink(missing_ok=True)
    values = json.loads((target / "config.json").read_text())
    values["dtype"] = "bfloat16"
    (target / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    stored = {**load_file(target / "model.safetensors"), **mtp_tensors(layer, layers, model)}
    stored = {
        key: tensor.float() if key.endswith("e_score_correction_bias") else tensor.to(dtype)
        for key, tensor in sorted(stored.items())
    }
    save_file(stored, target / "model.safetensors", metadata={"format": "pt"})
    np.save(target / "token_ids.npy", ids.numpy().astype(np.int32))
    np.save(target / "logits.npy", output.logits.float().numpy())
    np.save(target / "mtp_logits.npy", ahead.float().numpy())
    np.save(target / "greedy_ids.npy", greedy_ids(model, ids))
    print(f"{name}: seed {seed}, routing margin {margin:.4f}, {len(stored)} tensors")

    # The same model, its linear layers in block-scaled FP8; its logits those of the FP8
    # weights widened to float32 (loaded by transformers from such a copy).
    fp8 = out / f"{name}_fp8"
    shutil.rmtree(fp8, ignore_errors=True)
    fp8.mkdir(parents=True)
    quantized, widened = {}, {}
    for key, tensor in stored.items():
        if fp8_quantized(key, tensor):
            values_, scale = quantize_fp8(tensor, FP8_BLOCK)
            quantized[key], quantized[key + "_scale_inv"] = values_, scale
            widened[key] = dequantize_fp8(values_, scale, FP8_BLOCK)
        else:
            quantized[key] = tensor
            widened[key] = tensor.float()
    save_file(dict(sorted(quantized.items())), fp8 / "model.safetensors", metadata={"format": "pt"})
    values["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
    }
    (fp8 / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    with tempfile.TemporaryDirectory() as scratch:
        main = {k: v for k, v in widened.items() if not k.startswith(f"model.layers.{layers}.")}
        save_file(main, Path(scratch) / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(scratch)
        widened_model, loading = model_class.from_pretrained(
            scratch, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        assert not any(loading.values()), loading  # every weight, nothing else
        widened_model.eval()
        with torch.no_grad():
            output = widened_model(ids)
        greedy = greedy_ids(widened_model, ids)
    np.save(fp8 / "token_ids.npy", ids.numpy().astype(np.int32))
    np.save(fp8 / "logits.npy", output.logits.float().numpy())
    np.save(fp8 / "greedy_ids.npy", greedy)
    count = sum(fp8_quantized(key, tensor) for key, tensor in stored.items())
    print(f"{name}_fp8: {count} FP8 tensors, blocks {FP8_BLOCK}")


def greedy_ids(model: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    """``generate`` from the first PROMPT ids: greedy, no end-of-sequence id."""
    with torch.no_grad():
        prompt = ids[:, :PROMPT]
        greedy = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),  # every id is a token, none padding
            max_new_tokens=SEQ - PROMPT,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return greedy.numpy().astype(np.int32)


def make_family(name: str, out: Path, first_seed: int) -> None:
    if name == "deepseek_v3":
        make_deepseek(out, first_seed)
        return
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
    np.save(target / "greedy_ids.npy", greedy_ids(model.float(), ids))
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
