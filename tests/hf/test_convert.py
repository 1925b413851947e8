"""Hugging Face checkpoints in and out, against the real implementation.

The fixtures (``tests/fixtures/hf/<name>``, made by ``tools/make_hf_fixtures.py`` with
transformers) hold a tiny random model's weights and config.json, token ids and the
logits transformers computes for them (DeepSeek-V3's: its MTP module's too, and a copy
in block-scaled FP8). Here: the converted model's logits on 8 devices match (one forward
per fixture); HF -> jaxmoe -> HF is bit-exact, through a checkpoint restored in each
layout, and through several shards; every bad input is refused in one line before a
tensor is read.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxmoe.cli.main import main
from jaxmoe.cli.parser import config_from_train_args
from jaxmoe.config import Config, ConfigError, ParallelConfig
from jaxmoe.config.layout import ATTENTION_DATA, TENSOR, axes_for_role
from jaxmoe.hf.convert import FP8_DTYPE, from_hf, plan_from_hf, plan_to_hf, to_hf, write_hf
from jaxmoe.hf.files import read_tensors
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.train.checkpoint import RunCheckpoints, saved_config
from jaxmoe.train.resolved import resolve

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
# Fixture -> its family.
FIXTURE_FAMILIES = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v3_fp8": "deepseek_v3",
}
FIXTURE_NAMES = tuple(FIXTURE_FAMILIES)
SEQ = 16  # the fixtures' token rows
LAYOUTS = {
    "expert 8": dict(data=1, expert=8),
    "tensor 2": dict(data=1, expert=8, tensor=2),
    "expert_tensor 2": dict(data=1, expert=4, expert_tensor=2),
}


def tensors_of(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's shards (FP8 ones too, which safetensors' numpy
    reader cannot name)."""
    files = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "numpy") as handle:
            files[file] = list(handle.keys())
    return dict(read_tensors(files))


def assert_bit_exact(got: dict[str, np.ndarray], family: str) -> None:
    expected = tensors_of(FIXTURES / family)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert got[name].tobytes() == tensor.tobytes(), name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> the run directory of its converted fixture (converted once)."""
    runs = {}
    for name in FIXTURE_NAMES:
        out = tmp_path_factory.mktemp(f"run-{name}")
        from_hf(plan_from_hf(FIXTURES / name, {"model.seq_len": SEQ}), out)
        runs[name] = out
    return runs


def layout_config(run: Path, **parallel) -> Config:
    config = Config.from_dict(saved_config(run, 0))
    return dataclasses.replace(
        config,
        parallel=ParallelConfig(**parallel),
        train=dataclasses.replace(config.train, batch_size=8),
    )


def restored_state(run: Path, **parallel):
    config = layout_config(run, **parallel)
    mesh = build_mesh(config.parallel)
    return config, mesh, RunCheckpoints(run, resolve(config, mesh)).restore(0)


def logits_on_mesh(config: Config, mesh, state, tokens: np.ndarray) -> list[np.ndarray]:
    """The model's float32 logits for ``tokens``, then each MTP module's, computed per
    device in the run's shard_map (each device its rows; under tensor parallelism its
    positions)."""
    resolved = resolve(config)
    graphdef, names = resolved.graphdef, tuple(mesh.axis_names)
    collections = (state.params, state.model_state)[
        : 2 if jax.tree.leaves(state.model_state) else 1
    ]
    specs = (resolved.model_specs, resolved.specs.model_state)[: len(collections)]

    def per_device(collections, tokens):
        model = nnx.merge(graphdef, *collections)
        ahead = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
        outputs = model.outputs(tokens, next_tokens=ahead)
        return [outputs.logits, *outputs.ahead]

    out = PartitionSpec(
        axes_for_role(ATTENTION_DATA, names), axes_for_role(TENSOR, names) or None, None
    )
    forward = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs, token_spec(mesh)),
            out_specs=out,
            check_vma=False,
        )
    )
    tokens = jax.device_put(tokens, NamedSharding(mesh, token_spec(mesh)))
    return [np.asarray(logits) for logits in forward(collections, tokens)]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_converted_logits_match_transformers(converted, name):
    config, mesh, state = restored_state(converted[name], **LAYOUTS["expert 8"])
    ids = np.load(FIXTURES / name / "token_ids.npy")
    expected = np.load(FIXTURES / name / "logits.npy")
    copies = 8 // ids.shape[0]  # a row per device

    logits, *ahead = logits_on_mesh(config, mesh, state, np.tile(ids, (copies, 1)))

    np.testing.assert_allclose(logits, np.tile(expected, (copies, 1, 1)), rtol=0, atol=1e-4)
    if (FIXTURES / name / "mtp_logits.npy").is_file():  # the last position has no target
        expected = np.tile(np.load(FIXTURES / name / "mtp_logits.npy"), (copies, 1, 1))
        np.testing.assert_allclose(ahead[0][:, :-1], expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_hf_to_jaxmoe_to_hf_is_bit_exact(converted, name, tmp_path):
    plan = plan_to_hf(converted[name])
    stored = {"mixtral": "bfloat16", "deepseek_v3": "bfloat16", "deepseek_v3_fp8": FP8_DTYPE}
    assert plan.dtype == stored.get(name, "float32")

    assert to_hf(plan, tmp_path) == 1
    assert_bit_exact(tensors_of(tmp_path), name)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "name",
    [
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "deepseek_v3_fp8",
        pytest.param("deepseek_v3", marks=pytest.mark.slow),
    ],
)
def test_the_checkpoint_restores_in_every_layout_to_the_same_tensors(
    converted, name, layout, tmp_path
):
    config, _, state = restored_state(converted[name], **LAYOUTS[layout])
    assert jax.tree.leaves(state.params)[0].sharding.mesh.size == 8

    plan = plan_to_hf(converted[name])
    collections = {"params": state.params, "model_state": state.model_state}
    others = "bfloat16" if plan.fp8_block else plan.dtype
    family = FIXTURE_FAMILIES[name]
    write_hf(
        collections,
        family,
        config,
        tmp_path,
        others,
        values=plan.hf_values,
        fp8_block=plan.fp8_block,
    )

    assert_bit_exact(tensors_of(tmp_path), name)


def test_fp8_export_leaves_the_modules_the_config_leaves_out(converted, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(converted["deepseek_v3_fp8"], run)
    values = json.loads((run / "hf" / "config.json").read_text())
    values["quantization_config"]["modules_to_not_convert"] = ["lm_head", "self_attn.o_proj"]
    (run / "hf" / "config.json").write_text(json.dumps(values))

    to_hf(plan_to_hf(run), tmp_path / "out")

    tensors = tensors_of(tmp_path / "out")
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    assert tensors[o_proj].dtype == ml_dtypes.bfloat16 and o_proj + "_scale_inv" not in tensors
    q_b = "model.layers.1.self_attn.q_b_proj.weight"
    assert tensors[q_b].dtype == ml_dtypes.float8_e4m3fn and q_b + "_scale_inv" in tensors


def test_sharded_checkpoints_are_read_and_written_shard_by_shard(converted, tmp_path):
    exported, again, back = tmp_path / "sharded", tmp_path / "run", tmp_path / "back"
    to_hf(plan_to_hf(converted["qwen2_moe"]), exported, max_shard_bytes=64_000)
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 4 and files[0] == "model-00001-of-00004.safetensors"
    assert all((exported / file).stat().st_size < 64_000 + 8_000 for file in files)

    from_hf(plan_from_hf(exported, {"model.seq_len": SEQ}), again)
    to_hf(plan_to_hf(again), back)

    assert_bit_exact(tensors_of(back), "qwen2_moe")


FP8_BLOCKS_OF_32 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}


def test_kimi_k2_and_a_model_without_its_mtp_layers_convert(converted, tmp_path):
    kimi = broken_copy(tmp_path, "deepseek_v3_fp8", config={"model_type": "kimi_k2"})
    plan = plan_from_hf(kimi, {"model.seq_len": SEQ})
    assert plan.architecture.family == "deepseek_v3" and plan.config.model.mtp_depth == 1

    # Without its MTP module (transformers saves none): the layer's tensors are left.
    plan = plan_from_hf(kimi, {"model.seq_len": SEQ, "model.mtp_depth": 0})
    assert plan.config.model.mtp_depth == 0
    assert not any(name.startswith("model.layers.3.") for name in plan.rules)


def run_cli(argv, capsys):
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_cli_converts_and_prints_the_train_line_that_resumes(tmp_path, capsys):
    out, hf = tmp_path / "run", tmp_path / "hf"
    family = "qwen3_moe"
    source = ["--from-hf", str(FIXTURES / family), "--out", str(out)]
    flags = ["--model.seq_len", str(SEQ), "--parallel.expert", "8"]
    status, printed, _ = run_cli(["convert", *source, *flags], capsys)
    assert status == 0, printed
    line = printed.splitlines()[-1].split()
    assert line[:3] == ["jaxmoe", "train", "--preset"] and line[-1] == "--resume"
    resumed = config_from_train_args(line[2:])
    saved = Config.from_dict(saved_config(out, 0))
    assert resumed == saved and resumed.parallel.expert == 8
    assert (out / "hf" / "config.json").is_file()

    status, _, error = run_cli(["convert", *source, *flags], capsys)
    assert status == 2 and "already holds a run (checkpoints, hf): add --overwrite" in error
    status, _, _ = run_cli(["convert", *source, *flags, "--overwrite"], capsys)
    assert status == 0 and Config.from_dict(saved_config(out, 0)) == saved

    status, printed, _ = run_cli(["convert", "--to-hf", str(hf), "--out", str(out)], capsys)
    assert status == 0 and "1 safetensors file and config.json" in printed
    assert_bit_exact(tensors_of(hf), family)

    status, _, error = run_cli(["convert", "--to-hf", str(hf), "--out", str(out)], capsys)
    assert status == 2 and "already holds a model (config.json, model.safetensors)" in error
    status, _, _ = run_cli(
        ["convert", "--to-hf", str(hf), "--out", str(out), "--overwrite", "--dtype", "bfloat16"],
        capsys,
    )
    assert status == 0
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"


def broken_copy(tmp_path: Path, family: str, config=None, drop=(), add=None) -> Path:
    """A copy of a fixture with its config.json changed, tensors dropped or added."""
    target = tmp_path / f"broken-{family}"
    shutil.copytree(FIXTURES / family, target)
    values = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**values, **(config or {})}))
    if drop or add:
        tensors = {k: v for k, v in tensors_of(target).items() if k not in drop}
        save_file({**tensors, **(add or {})}, str(target / "model.safetensors"))
    return target


@pytest.mark.parametrize(
    ("family", "broken", "message"),
    [
        (
            "mixtral",
            dict(drop=["model.layers.1.block_sparse_moe.experts.5.w3.weight"]),
            "model.layers.1.block_sparse_moe.experts.5.w3.weight is missing from the "
            "safetensors files",
        ),
        (
            "qwen2_moe",
            dict(config={"num_key_value_heads": 4}),
            "model.layers.0.self_attn.k_proj.bias is [16], but config.json's "
            "[num_key_value_heads x head_dim] = [32]",
        ),
        (
            "qwen3_moe",
            dict(config={"moe_intermediate_size": 8}),
            "model.layers.0.mlp.experts.0.down_proj.weight is [32, 16], but config.json's "
            "[hidden_size, moe_intermediate_size] = [32, 8]",
        ),
        (
            "qwen3_moe",
            dict(config={"num_hidden_layers": 1}),
            "model.layers.1.input_layernorm.weight (and 32 more) is not a tensor of the "
            "qwen3_moe model config.json describes (config.json's num_hidden_layers is 1)",
        ),
        ("qwen3_moe", dict(config={"model_type": "llama"}), "model_type='llama' is not"),
        (
            "mixtral",
            dict(add={"model.layers.0.block_sparse_moe.gate.bias": np.zeros(8, np.int8)}),
            "model.layers.0.block_sparse_moe.gate.bias is not a tensor of the mixtral model",
        ),
        (
            "qwen2_moe",
            dict(config={"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
            "sliding_window=8 is shorter than model.seq_len=16 on some layers only",
        ),
        (
            "deepseek_v3_fp8",
            dict(drop=["model.layers.1.self_attn.o_proj.weight_scale_inv"]),
            "model.layers.1.self_attn.o_proj.weight is F8_E4M3 without its "
            "model.layers.1.self_attn.o_proj.weight_scale_inv",
        ),
        (
            "deepseek_v3_fp8",
            dict(config={"quantization_config": FP8_BLOCKS_OF_32}),
            "model.layers.0.mlp.down_proj.weight_scale_inv is F32 [2, 4], but "
            "model.layers.0.mlp.down_proj.weight [32, 64] in blocks of [32, 32] "
            "(quantization_config's weight_block_size) has [1, 2] float scales",
        ),
        (
            "deepseek_v3_fp8",
            dict(config={"quantization_config": None}),
            "is F8_E4M3, but config.json has no quantization_config giving its weight_block_size",
        ),
        (
            "deepseek_v3",
            dict(drop=[f"model.layers.3.{n}.weight" for n in ("enorm", "hnorm", "eh_proj")]),
            "model.layers.3.eh_proj.weight (and 2 more) is missing from the safetensors files "
            "(config.json's num_nextn_predict_layers names MTP layers after layer 2: convert "
            "with --model.mtp_depth 0 to leave them)",
        ),
        (
            "deepseek_v3",
            dict(config={"qk_head_dim": 20}),
            "qk_head_dim=20: must be 16 (qk_nope_head_dim=8, qk_rope_head_dim=8)",
        ),
    ],
)
def test_bad_checkpoints_are_refused_in_one_line_before_reading(
    family, broken, message, tmp_path, capsys
):
    source = broken_copy(tmp_path, family, **broken)
    out = tmp_path / "run"

    status, _, error = run_cli(
        ["convert", "--from-hf", str(source), "--out", str(out), "--model.seq_len", str(SEQ)],
        capsys,
    )

    assert status == 2
    assert message in error, error
    assert error.startswith("jaxmoe convert: error: ") and error.count("\n") == 1
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--from-hf", "nowhere"], "--from-hf nowhere: not a directory"),
        (["--from-hf", str(FIXTURES / "mixtral"), "--step", "3"], "--step applies to --to-hf"),
        (
            ["--from-hf", str(FIXTURES / "mixtral"), "--model.num_heads", "8"],
            "--model.num_heads: ",
        ),
        (["--to-hf", "x", "--model.seq_len", "8"], "--model.seq_len: configuration flags"),
        (["--to-hf", "x", "--max-shard-size", "lots"], "--max-shard-size lots: give a size"),
        (["--from-hf", str(FIXTURES / "mixtral"), "--to-hf", "x"], "not allowed with argument"),
    ],
)
def test_bad_flags_are_refused_in_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["convert", *argv, "--out", str(tmp_path / "run")]))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error


def test_exporting_a_run_not_converted_from_hf_needs_its_architecture(converted, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(converted["mixtral"], run)
    shutil.rmtree(run / "hf")
    with pytest.raises(ConfigError, match="name it with --model-type"):
        plan_to_hf(run)
    with pytest.raises(ConfigError, match=r"--step 7: .* has checkpoints of steps 0"):
        plan_to_hf(run, step=7, family="mixtral")
    # Another family's blocks: the saved field that conflicts, and the family that fits.
    with pytest.raises(ConfigError) as error:
        plan_to_hf(run, family="qwen3_moe")
    assert str(error.value) == (
        "--model-type qwen3_moe: the checkpoint of step 0 was trained with model.qk_norm=False, "
        "where a qwen3_moe model has True: give --model-type mixtral, whose blocks it has"
    )

    plan = plan_to_hf(run, family="mixtral")

    assert plan.dtype == "float32" and plan.hf_values["num_local_experts"] == 8
