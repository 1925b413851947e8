"""``jaxmoe convert``: Hugging Face checkpoints in and out of a run directory.

    jaxmoe convert --from-hf Qwen3-30B-A3B/ --out runs/qwen3 --model.seq_len 4096
    jaxmoe train --resume --out runs/qwen3 --preset qwen3_moe-tiny ...   (the line it prints)
    jaxmoe convert --to-hf exported/ --out runs/qwen3 [--step N] [--dtype bfloat16]

``--from-hf`` reads a transformers model directory (``config.json`` and safetensors
shards) of Mixtral, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3 (Kimi K2 too), block-scaled FP8
weights dequantized, into ``--out`` as the checkpoint of step 0
(the weights, a fresh optimizer state, the configuration), shard by shard, and prints
the ``jaxmoe train --resume`` line that continues from it; ``--SECTION.FIELD`` flags set
the fields config.json does not (``--model.seq_len``, ``--model.dtype``, ``--train.*``,
``--parallel.*`` for the printed line: the checkpoint restores into any layout).
``--to-hf`` writes the parameters of a checkpoint of ``--out`` (the newest, or
``--step``) as safetensors shards and ``config.json``. Both run on the host's CPU, on one
device, and check every input before reading a tensor: a bad one is one line and exit
status 2 (:mod:`jaxmoe.hf`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jaxmoe.config import Config, ConfigError
from jaxmoe.config.data import DataSource, parse_sources

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
DEFAULT_SHARD_SIZE = "5GB"
_TO_HF_FLAGS = ("step", "dtype", "model_type", "max_shard_size")


def add_arguments(command: argparse.ArgumentParser, override_fields: dict[str, Any]) -> None:
    direction = command.add_mutually_exclusive_group(required=True)
    direction.add_argument(
        "--from-hf", metavar="HF_DIR", help="read this transformers model directory into --out"
    )
    direction.add_argument(
        "--to-hf", metavar="HF_DIR", help="write a checkpoint of --out as a transformers model"
    )
    command.add_argument(
        "--out",
        required=True,
        metavar="RUN_DIR",
        help="the run directory: --from-hf writes its step-0 checkpoint, --to-hf reads one",
    )
    command.add_argument(
        "--overwrite", action="store_true", help="replace the run or model already there"
    )
    export = command.add_argument_group("--to-hf")
    export.add_argument("--step", type=int, help="the checkpoint to export (default: newest)")
    export.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "float8_e4m3fn"],
        help="the weights' dtype (default: the source model's, else float32); "
        "float8_e4m3fn: the linear layers' block-scaled FP8, the rest bfloat16",
    )
    export.add_argument(
        "--model-type",
        choices=FAMILIES,
        help="the architecture (default: the one the run was converted from)",
    )
    export.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help=f"largest safetensors file (default {DEFAULT_SHARD_SIZE})",
    )
    overrides = command.add_argument_group("--from-hf: configuration fields config.json leaves")
    for name, (_, _, parse) in override_fields.items():
        many = {"nargs": "+"} if parse is parse_sources else {}  # data.sources: FILE[:WEIGHT] ...
        overrides.add_argument(f"--{name}", dest=f"override:{name}", metavar="VALUE", **many)
    command.set_defaults(override_fields=override_fields)


def requested_values(args: argparse.Namespace) -> dict[str, Any]:
    """``'section.field' -> value`` for every ``--SECTION.FIELD`` flag given."""
    values = {}
    for key, text in vars(args).items():
        if not key.startswith("override:") or text is None:
            continue
        name = key.removeprefix("override:")
        try:
            values[name] = args.override_fields[name][2](text)
        except ValueError:
            raise ConfigError(f"--{name}: cannot read {text!r} as a value of this field") from None
    return values


def _flag_values(name: str, value: Any) -> list[str]:
    """The command line's values of the field ``name`` at ``value`` (as ``to_dict`` has it)."""
    if name == "data.sources":
        return [DataSource(**source).text for source in value] or ["none"]
    if value is None:
        return ["none"]
    if isinstance(value, bool):
        return [str(value).lower()]
    return [str(value)]


def train_command_line(config: Config, family: str, out: str) -> list[str]:
    """The ``jaxmoe train`` arguments that resume the converted run: the family's tiny
    preset and every field the configuration holds otherwise."""
    from jaxmoe.presets import preset

    base = preset(f"{family}-tiny").to_dict()
    args = ["train", "--preset", f"{family}-tiny"]
    for section, values in config.to_dict().items():
        for field, value in values.items():
            if base[section].get(field) != value:
                args += [f"--{section}.{field}", *_flag_values(f"{section}.{field}", value)]
    return [*args, "--out", out, "--resume"]


def _from_hf(args: argparse.Namespace) -> int:
    import shutil

    import jax

    from jaxmoe.cli.run_dir import RUN_FILES, check_free_space, clear_run_files, prepare_run_dir
    from jaxmoe.hf.convert import HF_DIR, abstract_leaves, from_hf, plan_from_hf
    from jaxmoe.plan.host_memory import host_memory_bytes
    from jaxmoe.train.resolved import resolve

    given = [f"--{flag.replace('_', '-')}" for flag in _TO_HF_FLAGS if getattr(args, flag)]
    if given:
        raise ConfigError(f"{given[0]} applies to --to-hf, not --from-hf")
    out = Path(args.out)
    existing = [name for name in (*RUN_FILES, HF_DIR) if (out / name).exists()]
    if existing and not args.overwrite:
        raise ConfigError(
            f"--out {out} already holds a run ({', '.join(existing)}): add --overwrite to "
            "replace it, or choose another directory"
        )
    prepare_run_dir(out, resume=False, overwrite=True, primary=False)  # writable, not cleared
    plan = plan_from_hf(args.from_hf, requested_values(args))
    parameters = sum(leaf.size for leaf in jax.tree.leaves(abstract_leaves(plan.config)))
    state = sum(
        leaf.size * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(resolve(plan.config).state_shapes)
    )
    check_free_space(out, state)
    if state > host_memory_bytes():
        raise ConfigError(
            f"--from-hf: the checkpoint's state (the parameters and the optimizer's moments, "
            f"float32) takes {state / 1e9:.1f} GB, more than this host's "
            f"{host_memory_bytes() / 1e9:.1f} GB: convert on a larger host"
        )
    if args.overwrite:
        clear_run_files(out)
        shutil.rmtree(out / HF_DIR, ignore_errors=True)
    tensors = from_hf(plan, out)
    family = plan.architecture.family
    line = " ".join(train_command_line(plan.config, family, str(out)))
    print(
        f"converted {plan.directory} ({family}, {tensors} tensors, {parameters / 1e6:.2f}M "
        f"parameters) into {out}: the checkpoint of step 0, and the source's config.json and "
        f"tokenizer files in {out / HF_DIR}\ntrain it (any layout: change --parallel.*):\n"
        f"  jaxmoe {line}"
    )
    return 0


def _to_hf(args: argparse.Namespace) -> int:
    from jaxmoe.hf.convert import clear_model_files, plan_to_hf, to_hf
    from jaxmoe.hf.files import parse_size

    overrides = sorted(requested_values(args))
    if overrides:
        raise ConfigError(f"--{overrides[0]}: configuration flags apply to --from-hf")
    max_shard = parse_size(args.max_shard_size or DEFAULT_SHARD_SIZE)
    out, target = Path(args.out), Path(args.to_hf)
    if not out.is_dir():
        raise ConfigError(f"--out {out}: not a run directory")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--to-hf {target}: is a file, not a directory: choose a directory")
    plan = plan_to_hf(out, args.step, args.model_type, args.dtype)
    clear_model_files(target, args.overwrite)
    shards = to_hf(plan, target, max_shard)
    print(
        f"wrote {target}: the {plan.family} model of the checkpoint of step {plan.step} of "
        f"{out}, {plan.dtype}, {shards} safetensors file{'s' if shards > 1 else ''} and "
        "config.json"
    )
    return 0


def run(config: Config | None, args: argparse.Namespace) -> int:
    """Convert (``config`` is unused: the configuration comes from config.json or the
    checkpoint)."""
    return _from_hf(args) if args.from_hf is not None else _to_hf(args)
