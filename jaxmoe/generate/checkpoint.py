"""A run directory's model for decoding: its configuration and parameters, on one device.

``DIR`` is the ``--out`` of ``jaxmoe train`` (or a converted model's directory of the
same layout): ``DIR/checkpoints/<step>`` with the items ``state`` and ``config``
(:mod:`jaxmoe.train.checkpoint`). The newest checkpoint that can be read is used; only
its parameters (and model state, such as the routers' expert biases) are read, not the
optimizer state, into plain single-device arrays: decoding needs no mesh. Nothing in
``DIR`` is changed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import jax
from flax import nnx

from jaxmoe.config import Config, ConfigError
from jaxmoe.generate.decoder import inference_moe
from jaxmoe.layers import GPTMoE
from jaxmoe.train.checkpoint import (
    CHECKPOINT_DIR,
    checkpoint_steps,
    error_reason,
    restore_model,
    saved_config,
)
from jaxmoe.train.resolved import resolve


@dataclass(frozen=True)
class RunModel:
    """A checkpoint's model, built for decoding (dropless MoE layers)."""

    config: Config  # as saved with the checkpoint
    model: GPTMoE
    step: int


def _abstract_model(config: Config) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """The decoding model's structure, its parameters' and its other variables' shapes
    (the expert biases: not parameters, saved apart as ``model_state``)."""
    model = nnx.eval_shape(
        lambda: GPTMoE(config.model, inference_moe(config.moe), rngs=nnx.Rngs(0))
    )
    return nnx.split(model, nnx.Param, ...)


def _load_step(run_dir: Path, step: int, device: jax.Device) -> RunModel:
    config = Config.from_dict(saved_config(run_dir, step))
    graphdef, params, rest = _abstract_model(config)
    restored = restore_model(run_dir, step, resolve(config), device)
    nnx.replace_by_pure_dict(params, restored["params"])
    if "model_state" in restored:
        nnx.replace_by_pure_dict(rest, restored["model_state"])
    return RunModel(config=config, model=nnx.merge(graphdef, params, rest), step=step)


def load_run_model(run_dir: str | Path, device: jax.Device | None = None) -> RunModel:
    """The newest readable checkpoint of ``run_dir``'s model, on ``device`` (default: the
    first). A checkpoint that cannot be read is passed over, saying so on stderr;
    ConfigError (one line) without a directory, a checkpoint, or a readable one."""
    run_dir = Path(run_dir)
    where = f"--checkpoint {run_dir}"
    if run_dir.exists() and not run_dir.is_dir():
        run = next((p for p in run_dir.absolute().parents if (p / CHECKPOINT_DIR).is_dir()), None)
        fix = f"the run it is in, --checkpoint {run}" if run else "the --out of a jaxmoe train run"
        raise ConfigError(f"{where}: is a file, not a run directory: give {fix}")
    if not run_dir.is_dir():
        raise ConfigError(f"{where}: no such directory: give the --out of a jaxmoe train run")
    if not (run_dir / CHECKPOINT_DIR).is_dir() or not (steps := checkpoint_steps(run_dir)):
        raise ConfigError(
            f"{where}: holds no checkpoint ({CHECKPOINT_DIR}/<step>): give the --out of a "
            "jaxmoe train run that saved one, or a converted model's directory"
        )
    device = device or jax.devices()[0]
    unreadable = {}
    for step in steps:
        try:
            return _load_step(run_dir, step, device)
        except Exception as error:  # whatever Orbax, TensorStore or the config raise
            unreadable[step] = error_reason(error)
            if step == steps[-1]:
                break
            print(
                f"jaxmoe generate: the checkpoint of step {step} cannot be read "
                f"({unreadable[step]}): trying the one before it",
                file=sys.stderr,
                flush=True,
            )
    reasons = "; ".join(f"step {step} ({why})" for step, why in unreadable.items())
    raise ConfigError(
        f"{where}: no checkpoint can be read: {reasons}; give a run directory whose "
        "checkpoints are intact"
    )
