"""Hugging Face checkpoints in and out of jaxmoe runs.

In (:func:`plan_from_hf`, then :func:`from_hf`): a transformers model directory
(``config.json`` and safetensors shards) becomes a run directory whose checkpoint of step
0 holds the model's weights, a fresh optimizer state and the configuration
(:mod:`jaxmoe.hf.architectures`), written by the run's own checkpoint code
(:class:`~jaxmoe.train.checkpoint.RunCheckpoints`), so that ``jaxmoe train --resume``
continues from it on any layout. Everything is checked before a tensor is read: the
configuration, every tensor's presence, shape and dtype against it. The tensors are then
read shard by shard, one at a time, each placed into its jaxmoe parameter (a transpose
and a reshape, :mod:`jaxmoe.hf.tensors`); a parameter goes to the device once all its
parts are in, so the model is held once, plus the parameters still being filled. The
conversion runs on one device of the host (the CPU), whatever layout the run will train
on: restoring reshards. The source's ``config.json`` and tokenizer files are kept in
``RUN/hf/``.

Out (:func:`to_hf`): the parameters of a run's checkpoint (restored alone, without the
optimizer state) become safetensors shards named as transformers names them, in
float32 or bfloat16, with the ``config.json`` of the model (on top of the source's, when
the run was converted from one) and the tokenizer files the run kept.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxmoe.config import Config, ConfigError
from jaxmoe.hf.architectures import FAMILIES, Architecture, read_architecture, rotary_interleaved
from jaxmoe.hf.block_fp8 import (
    POWER_OF_TWO,
    SCALE_SUFFIX,
    dequantize,
    quantize,
    scale_name,
    scale_shape,
)
from jaxmoe.hf.files import (
    CONFIG,
    FP8_STORED,
    READ_DTYPES,
    WRITE_DTYPES,
    TensorInfo,
    copy_side_files,
    model_files,
    plan_shards,
    read_config,
    read_headers,
    read_tensors,
    shard_names,
    write_config,
    write_index,
    write_shard,
)
from jaxmoe.hf.hf_config import architecture_of, hf_config, inexpressible
from jaxmoe.hf.tensors import IGNORED_SUFFIXES, TensorRule, tensor_rules
from jaxmoe.presets import preset

HF_DIR = "hf"  # RUN/hf/: the source's config.json and tokenizer files
# The fields a converted configuration may take from the command line although
# config.json sets them: the training sequence, the compute dtype, token dropping, and
# how many of the stored multi-token prediction modules to train.
FREE_FIELDS = {"model.seq_len", "model.dtype", "moe.capacity_factor", "model.mtp_depth"}
# --dtype of block-scaled FP8 linear weights (the other tensors in bfloat16).
FP8_DTYPE = "float8_e4m3fn"
DEFAULT_FP8_BLOCK = (128, 128)


# -- Hugging Face -> jaxmoe ---------------------------------------------------------------------


@dataclass(frozen=True)
class FromHF:
    """A checked conversion: the model directory, its architecture, the run's
    configuration, and every tensor with its rule."""

    directory: Path
    architecture: Architecture
    config: Config
    headers: dict[str, TensorInfo]
    rules: dict[str, TensorRule]


def converted_config(architecture: Architecture, overrides: dict[str, Any]) -> Config:
    """The run configuration of a converted model: the family's ``-tiny`` preset for
    training, the model and MoE sections from ``config.json``, one device (restoring
    reshards), then ``overrides`` (``section.field`` -> value; the fields config.json
    sets are refused, but for :data:`FREE_FIELDS`)."""
    values = preset(f"{architecture.family}-tiny").to_dict()
    values["model"].update(architecture.model)
    values["moe"].update(architecture.moe)
    values["parallel"].update(data=1, expert=1, tensor=1, expert_tensor=1)
    for name, value in overrides.items():
        section, field = name.split(".")
        owned = architecture.model if section == "model" else architecture.moe
        if section in ("model", "moe") and field in owned and name not in FREE_FIELDS:
            raise ConfigError(
                f"--{name}: {architecture.source} sets it; a converted model keeps its "
                f"architecture (the free fields: {', '.join(sorted(FREE_FIELDS))})"
            )
        values[section][field] = value
    config = Config.from_dict(values)
    architecture.check_config(config)
    return config


def abstract_leaves(config: Config) -> dict[str, Any]:
    """Collection (``params``, and ``model_state`` when the model has one) -> the pure dict
    of its shapes, nothing allocated."""
    from jaxmoe.train.resolved import resolve

    state = resolve(config).state_shapes
    trees = {"params": state.params}
    model_state = getattr(state, "model_state", None)
    if model_state is not None:
        trees["model_state"] = model_state
    return trees


def _rules_for(
    family: str, trees: dict[str, Any], config: Config, values: dict[str, Any] | None
) -> dict[str, TensorRule]:
    """The tensor table of ``config``'s model as a ``family`` model with the
    ``config.json`` ``values`` (None: a new file)."""
    from jaxmoe.hf.tensors import leaf_shapes

    interleaved = config.model.rotary_head_dim if rotary_interleaved(values, family) else 0
    shapes = {name: leaf_shapes(tree) for name, tree in trees.items()}
    return tensor_rules(family, shapes, interleaved)


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None


def _ignorable(name: str, config: Config, architecture: Architecture) -> bool:
    """Tensors the files may hold that the run does not read: old rotary tables, a tied
    head, FP8 scales (read with their weight), the MTP layers beyond ``model.mtp_depth``."""
    if name.endswith((*IGNORED_SUFFIXES, SCALE_SUFFIX)):
        return True
    if name == "lm_head.weight" and config.model.tie_embeddings:
        return True
    layer = _layer_of(name)
    stored = architecture.model.get("mtp_depth", 0)
    first = config.model.num_layers + config.model.mtp_depth
    return layer is not None and first <= layer < config.model.num_layers + stored


def _unexpected_hint(name: str, config: Config, family: str) -> str:
    """Which config.json field a tensor beyond the model points at."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and parts[2].isdigit():
        if int(parts[2]) >= config.model.num_layers:
            mtp = config.model.mtp_depth
            more = f" and {mtp} MTP layer{'s' if mtp > 1 else ''}" if mtp else ""
            return f" (config.json's num_hidden_layers is {config.model.num_layers}{more})"
        if "experts" in parts:
            expert = parts[parts.index("experts") + 1]
            if expert.isdigit() and int(expert) >= config.moe.num_experts:
                return f" (config.json has {config.moe.num_experts} experts)"
    return ""


def check_tensors(
    directory: Path,
    headers: dict[str, TensorInfo],
    rules: dict[str, TensorRule],
    config: Config,
    architecture: Architecture,
) -> None:
    """Every tensor the model needs is there, of its shape and a float dtype (FP8 with
    its block scales where config.json says so), and no other. The copies of the
    embedding and head an MTP layer keeps may be absent: they are not read."""
    family = architecture.family
    missing = [name for name, rule in rules.items() if name not in headers and not rule.copy]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        layer = _layer_of(missing[0])
        hint = (
            f" (config.json's num_nextn_predict_layers names MTP layers after layer "
            f"{config.model.num_layers - 1}: convert with --model.mtp_depth 0 to leave them)"
            if layer is not None and layer >= config.model.num_layers
            else ""
        )
        raise ConfigError(
            f"--from-hf {directory}: {missing[0]}{more} is missing from the safetensors "
            f"files{hint}: they do not hold the {family} model config.json describes"
        )
    unexpected = sorted(
        n for n in headers if n not in rules and not _ignorable(n, config, architecture)
    )
    if unexpected:
        name = unexpected[0]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConfigError(
            f"{headers[name].file}: {name}{more} is not a tensor of the {family} model "
            f"config.json describes{_unexpected_hint(name, config, family)}: the weights and "
            "config.json are of different models"
        )
    for name, rule in rules.items():
        info = headers.get(name)
        if info is None:
            continue
        if info.shape != rule.hf_shape:
            raise ConfigError(
                f"{info.file}: {name} is {list(info.shape)}, but config.json's "
                f"[{', '.join(rule.dims)}] = {list(rule.hf_shape)}: the weights and "
                "config.json are of different models"
            )
        if info.dtype == FP8_STORED and not rule.copy:
            _check_fp8(name, info, headers, architecture)
        elif info.dtype not in READ_DTYPES and not rule.copy:
            raise ConfigError(
                f"{info.file}: {name} is {info.dtype}: jaxmoe reads "
                f"{', '.join(READ_DTYPES)} weights, and block-scaled {FP8_STORED} ones"
            )


def _check_fp8(
    name: str, info: TensorInfo, headers: dict[str, TensorInfo], architecture: Architecture
) -> None:
    """An FP8 weight has its ``weight_scale_inv``, one float per block config.json gives."""
    block = architecture.fp8_block
    if block is None:
        raise ConfigError(
            f"{info.file}: {name} is {FP8_STORED}, but config.json has no quantization_config "
            "giving its weight_block_size: the weights and config.json are of different models"
        )
    scale = headers.get(scale_name(name))
    if scale is None:
        raise ConfigError(
            f"{info.file}: {name} is {FP8_STORED} without its {scale_name(name)}: jaxmoe reads "
            "FP8 weights with their block scales"
        )
    expected = scale_shape(info.shape, block)
    if scale.shape != expected or scale.dtype not in READ_DTYPES:
        raise ConfigError(
            f"{scale.file}: {scale_name(name)} is {scale.dtype} {list(scale.shape)}, but "
            f"{name} {list(info.shape)} in blocks of {list(block)} (quantization_config's "
            f"weight_block_size) has {list(expected)} float scales"
        )


def plan_from_hf(directory: str | Path, overrides: dict[str, Any] | None = None) -> FromHF:
    """Read and check a model directory against the configuration it gives, reading no
    tensor data: what :func:`from_hf` converts. One-line :class:`ConfigError` otherwise."""
    directory = Path(directory)
    values = read_config(directory)
    architecture = read_architecture(values, str(directory / CONFIG))
    config = converted_config(architecture, overrides or {})
    headers = read_headers(directory)
    rules = _rules_for(architecture.family, abstract_leaves(config), config, values)
    check_tensors(directory, headers, rules, config, architecture)
    return FromHF(directory, architecture, config, headers, rules)


def load_weights(plan: FromHF, device: Any) -> dict[str, Any]:
    """The converted collections (pure dicts of arrays on ``device``), read shard by shard.

    A leaf is filled in a host buffer of its dtype as its parts arrive and put on the
    device once complete, so the host holds the leaves being filled, not the model."""
    import jax

    trees = abstract_leaves(plan.config)
    flat = {name: dict(zip(*_paths_and_leaves(tree), strict=True)) for name, tree in trees.items()}
    read = {name: rule for name, rule in plan.rules.items() if not rule.copy}
    remaining: dict[tuple, int] = {}
    for rule in read.values():
        key = (rule.collection, rule.path)
        remaining[key] = remaining.get(key, 0) + 1
    scales = _fp8_scales(plan, read)
    buffers: dict[tuple, np.ndarray] = {}
    placed: dict[tuple, Any] = {}
    files: dict[Path, list[str]] = {}
    for name in read:
        files.setdefault(plan.headers[name].file, []).append(name)
    for name, tensor in read_tensors(files):
        rule = read[name]
        key = (rule.collection, rule.path)
        abstract = flat[rule.collection][rule.path]
        if name in scales:
            tensor = dequantize(tensor, scales.pop(name), plan.architecture.fp8_block)
        if key not in buffers:
            buffers[key] = np.empty(abstract.shape, abstract.dtype)
        buffers[key][rule.index] = rule.to_jaxmoe(tensor).astype(abstract.dtype)
        del tensor
        remaining[key] -= 1
        if not remaining[key]:
            placed[key] = jax.device_put(buffers.pop(key), device)
    return {
        name: _rebuild(tree, {path: placed[(name, path)] for path in flat[name]})
        for name, tree in trees.items()
    }


def _fp8_scales(plan: FromHF, read: dict[str, TensorRule]) -> dict[str, np.ndarray]:
    """FP8 weight -> its block scales, read first (a scale may be in another shard)."""
    files: dict[Path, list[str]] = {}
    for name in read:
        if plan.headers[name].dtype == FP8_STORED:
            scale = plan.headers[scale_name(name)]
            files.setdefault(scale.file, []).append(scale_name(name))
    return {
        name.removesuffix(SCALE_SUFFIX): tensor.astype(np.float32)
        for name, tensor in read_tensors(files)
    }


def _paths_and_leaves(tree: Any) -> tuple[list[tuple], list[Any]]:
    import jax

    from jaxmoe.hf.tensors import _key

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [tuple(_key(e) for e in path) for path, _ in flat], [leaf for _, leaf in flat]


def _rebuild(tree: Any, leaves: dict[tuple, Any]) -> Any:
    import jax

    paths, _ = _paths_and_leaves(tree)
    treedef = jax.tree_util.tree_structure(tree)
    return jax.tree_util.tree_unflatten(treedef, [leaves[path] for path in paths])


def host_device() -> Any:
    """The device a conversion runs on: the host's CPU (the first one)."""
    import jax

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # a platform list without the CPU
        return jax.devices()[0]


def from_hf(plan: FromHF, out: str | Path) -> int:
    """Write ``plan``'s model as the step-0 checkpoint of the run directory ``out``, with
    a fresh optimizer state (the caller has checked ``out``). Returns the tensors read."""
    import jax

    from jaxmoe.train.checkpoint import RunCheckpoints
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.state import train_state_around

    out = Path(out)
    device = host_device()
    collections = load_weights(plan, device)
    with jax.default_device(device):
        extra = {"model_state": collections["model_state"]} if "model_state" in collections else {}
        run = resolve(plan.config)
        state = train_state_around(run, collections["params"], **extra)
    with RunCheckpoints(out, run) as checkpoints:
        checkpoints.save(state)
    kept = out / HF_DIR
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    shutil.copyfile(plan.directory / CONFIG, kept / CONFIG)
    copy_side_files(plan.directory, kept)
    return len(plan.rules)


# -- jaxmoe -> Hugging Face ---------------------------------------------------------------------


@dataclass(frozen=True)
class ToHF:
    """A checked export: the run, its checkpoint's step and configuration, the family,
    dtype and ``config.json`` to write."""

    run: Path
    step: int
    config: Config
    family: str
    dtype: str  # FP8_DTYPE: block-scaled FP8 linear weights, the other tensors bfloat16
    hf_values: dict[str, Any]
    fp8_block: tuple[int, int] | None = None


def plan_to_hf(
    run: str | Path, step: int | None = None, family: str | None = None, dtype: str | None = None
) -> ToHF:
    """The checkpoint to export (the newest, or ``step``) and what it becomes, checked
    before anything is restored."""
    from jaxmoe.train.checkpoint import checkpoint_steps, saved_config

    run = Path(run)
    steps = checkpoint_steps(run)
    if not steps:
        raise ConfigError(f"--out {run}: holds no checkpoint to convert")
    if step is None:
        step = steps[0]
    elif step not in steps:
        raise ConfigError(
            f"--step {step}: {run} has checkpoints of steps {', '.join(map(str, steps))}"
        )
    try:
        config = Config.from_dict(saved_config(run, step))
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(f"--out {run}: the checkpoint of step {step} cannot be read") from error
    base_path = run / HF_DIR / CONFIG
    base = read_config(run / HF_DIR) if base_path.is_file() else None
    fitting = [other for other in FAMILIES if inexpressible(config, other) is None]
    if family is not None:
        _refuse_family(config, step, family, f"--model-type {family}", fitting)
    elif base is None and not fitting:  # no family named, and none would do
        _refuse_family(config, step, FAMILIES[0], "--to-hf", fitting)
    family = architecture_of(config, base, family)
    where = f"--to-hf (the run was converted from a {family} model)"
    _refuse_family(config, step, family, where, fitting)
    base_block = _stored_fp8_block(base)
    if dtype is None:
        stored = (base or {}).get("dtype", (base or {}).get("torch_dtype"))
        dtype = FP8_DTYPE if base_block else stored if stored in WRITE_DTYPES else "float32"
    block = (base_block or DEFAULT_FP8_BLOCK) if dtype == FP8_DTYPE else None
    others = "bfloat16" if block else dtype
    values = hf_config(config, family, others, base, block)
    return ToHF(run, step, config, family, dtype, values, block)


def _stored_fp8_block(base: dict[str, Any] | None) -> tuple[int, int] | None:
    """The FP8 block of the model a run was converted from (None: not FP8)."""
    if base is None or base.get("quantization_config") is None:
        return None
    return read_architecture(base, "the run's hf/config.json").fp8_block


def _refuse_family(config: Config, step: int, family: str, where: str, fitting: list[str]) -> None:
    """ConfigError, in one line beginning with ``where``, if ``family``'s model cannot
    express the checkpoint's configuration: the saved field that conflicts, and the family
    that fits it (``fitting``), if any."""
    mismatch = inexpressible(config, family)
    if mismatch is None:
        return
    field, value, needed = mismatch
    fix = (
        f"give --model-type {fitting[0]}, whose blocks it has"
        if fitting
        else f"it has the blocks of no family jaxmoe writes ({', '.join(FAMILIES)}); export "
        f"a run trained from one of their presets (--preset {FAMILIES[0]}-tiny, ...)"
    )
    raise ConfigError(
        f"{where}: the checkpoint of step {step} was trained with {field}={value!r}, where a "
        f"{family} model has {needed!r}: {fix}"
    )


def restore_params(run: Path, step: int, config: Config, device: Any) -> dict[str, Any]:
    """The parameters (and model state) of the checkpoint of ``step``, alone, on ``device``."""
    from jaxmoe.train.checkpoint import restore_model
    from jaxmoe.train.resolved import resolve

    return restore_model(run, step, resolve(config), device)


def write_hf(
    collections: dict[str, Any],
    family: str,
    config: Config,
    directory: str | Path,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 10**9,
    values: dict[str, Any] | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> dict[str, str]:
    """Write the model's tensors (``collections``: ``params`` and maybe ``model_state``,
    pure dicts of arrays) into ``directory`` as transformers names them, in ``dtype``, or
    with ``fp8_block`` the linear layers' as block-scaled FP8 and the rest in ``dtype``;
    ``values``: the config.json they go with (None: a new one). Returns the weight map
    (tensor -> file). The FP8 tensors are :attr:`~jaxmoe.hf.tensors.TensorRule.block_fp8`'s,
    but for those ``values``' ``quantization_config`` leaves out (``modules_to_not_convert``,
    matched as transformers does: any part of the name). The config.json is the caller's
    to write."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rules = _rules_for(family, collections, config, values)
    leaves = {
        name: dict(zip(*_paths_and_leaves(tree), strict=True)) for name, tree in collections.items()
    }
    target = WRITE_DTYPES[dtype]
    settings = (values or {}).get("quantization_config") or {}
    kept = settings.get("modules_to_not_convert") or []  # transformers': module names' parts
    quantized = {
        name
        for name, rule in rules.items()
        if fp8_block and rule.block_fp8 and not any(part in name for part in kept)
    }
    power_of_two = settings.get("scale_fmt") == POWER_OF_TWO
    dtypes = {name: np.float32 if rule.kept_float32 else target for name, rule in rules.items()}
    sizes = []
    for name, rule in rules.items():
        elements = int(np.prod(rule.hf_shape))
        if name in quantized:
            sizes.append((name, elements + 4 * int(np.prod(scale_shape(rule.hf_shape, fp8_block)))))
        else:
            sizes.append((name, elements * np.dtype(dtypes[name]).itemsize))
    shards = plan_shards(sizes, max_shard_bytes)
    files = shard_names(len(shards))
    weight_map = {}
    for file, names in zip(files, shards, strict=True):
        tensors = {}
        for name in names:
            rule = rules[name]
            leaf = np.asarray(leaves[rule.collection][rule.path])
            tensor = rule.to_hf(leaf[rule.index])
            if name in quantized:
                tensors[name], tensors[scale_name(name)] = quantize(tensor, fp8_block, power_of_two)
                weight_map[scale_name(name)] = file
            else:
                tensors[name] = tensor.astype(dtypes[name])
            weight_map[name] = file
        write_shard(directory / file, tensors)
        del tensors
    if len(files) > 1:
        write_index(directory, weight_map, sum(size for _, size in sizes))
    return weight_map


def to_hf(plan: ToHF, directory: str | Path, max_shard_bytes: int = 5 * 10**9) -> int:
    """Export ``plan``'s checkpoint into ``directory`` (the caller has cleared it): the
    shards, config.json and the tokenizer files the run kept. Returns the shard count."""
    directory = Path(directory)
    collections = restore_params(plan.run, plan.step, plan.config, host_device())
    others = "bfloat16" if plan.fp8_block else plan.dtype
    weight_map = write_hf(
        collections,
        plan.family,
        plan.config,
        directory,
        others,
        max_shard_bytes,
        plan.hf_values,
        plan.fp8_block,
    )
    write_config(directory, plan.hf_values)
    kept = plan.run / HF_DIR
    if kept.is_dir():
        copy_side_files(kept, directory)
    return len(set(weight_map.values()))


def clear_model_files(directory: Path, overwrite: bool) -> None:
    """Refuse a directory that holds a model unless ``overwrite``; then remove its
    weights, index and config.json (nothing else)."""
    existing = model_files(directory)
    if existing and not overwrite:
        names = ", ".join(sorted(path.name for path in existing)[:3])
        raise ConfigError(
            f"--to-hf {directory}: already holds a model ({names}): add --overwrite to "
            "replace it, or choose another directory"
        )
    for path in existing:
        path.unlink()
