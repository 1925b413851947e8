"""Checkpoints of a run, written with Orbax: save, keep the last few, restore anywhere.

A checkpoint is a directory ``OUT/checkpoints/<step>`` of three items:

- ``state``: the whole :class:`~jaxmoe.train.state.TrainState` (step, parameters,
  optimizer state, and the model state such as the expert biases of auxiliary-loss-free
  balancing) as sharded arrays; every process writes only its own shards.
- ``run``: where the run stands besides the state: the next step, the data position
  and the random streams. The data position is the index of the next example of the
  run's global sequence (:class:`~jaxmoe.data.host_batches.DataPosition`), the same in
  every layout; router noise is a function of ``(train.seed, step)``
  (``jaxmoe.train.step``).
- ``config``: the configuration the checkpoint was written under.

Saving is asynchronous: :meth:`RunCheckpoints.save` returns once the arrays are
copied off the devices, and the files are written in the background while training
goes on. It is atomic: Orbax writes into a temporary directory and renames it when
every process has finished, so a crash mid-save leaves the previous checkpoints as
they were, and the half-written one is ignored (and removed on the next start).

Restoring reads into the current layout: each array lands with the sharding that the
current mesh gives it, so a checkpoint written on ``data x expert = 1 x 8`` restores
on ``2 x 4``, or in a run with a different number of processes. A checkpoint written
under another pipeline (``parallel.pipeline``, ``parallel.virtual_stages``; the blocks
stacked by stage, :mod:`jaxmoe.pipeline.params`) is read in the layout it was
written in, each stacked array split as the current mesh splits its layers (over the
pipeline axis, where the current mesh has one), and then moved into the current
layout, values unchanged. A checkpoint whose arrays the current model would shape
otherwise is refused (:func:`check_compatible`); one written under another compute dtype
or recomputation, which leave the arrays as they are, is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import type_handlers

from jaxmoe.config import Config, ConfigError, ModelConfig, MoEConfig
from jaxmoe.config.moe import saved_moe_fields
from jaxmoe.data.host_batches import DataPosition
from jaxmoe.experimental import DEFAULT
from jaxmoe.pipeline.params import (
    PIPELINE_AXIS,
    StageLayout,
    layout_of,
    to_layout,
    to_layout_specs,
)
from jaxmoe.train.resolved import Run
from jaxmoe.train.state import (
    TrainState,
    abstract_model,
    abstract_sharded_state,
    param_trees_mapped,
)

CHECKPOINT_DIR = "checkpoints"
# What a checkpoint that cannot be read is renamed to: <step>.unreadable.
SET_ASIDE_SUFFIX = ".unreadable"


def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The handlers of the three items.

    Arrays are written by their first replica. Orbax's default on CPU spreads a
    replicated array over its replicas in slices, which costs one compiled slice per
    replica and array on the first save (seconds on 8 fake devices) for no gain on a
    local disk; GPU backends have it off by default too.
    """
    arrays = type_handlers.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler(use_replica_parallel=False))
    )
    state_handler = ocp.PyTreeCheckpointHandler(type_handler_registry=arrays)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state_handler)
    registry.add("state", ocp.args.PyTreeRestore, state_handler)
    for item in ("run", "config"):
        registry.add(item, ocp.args.JsonSave)
        registry.add(item, ocp.args.JsonRestore)
    return registry


def _manager(directory: Path, keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        # A save interrupted by a crash leaves a temporary directory: remove it.
        cleanup_tmp_directories=True,
        enable_async_checkpointing=True,
    )
    return ocp.CheckpointManager(
        directory.absolute(), options=options, handler_registry=_handler_registry()
    )


def checkpoint_steps(out_dir: Path) -> list[int]:
    """The steps of the complete checkpoints under ``out_dir``, newest first.

    Reads the directory only: a half-written checkpoint does not count, nor one set aside
    as unreadable.
    """
    return sorted(ocp.utils.checkpoint_steps(out_dir / CHECKPOINT_DIR), reverse=True)


def _tree_metadata(out_dir: Path, step: int) -> Path:
    """The file that describes the tree of the checkpoint of ``step``'s state: without it,
    the checkpoint cannot be read."""
    return out_dir / CHECKPOINT_DIR / str(step) / "state" / "_METADATA"


def newest_described(out_dir: Path) -> int | None:
    """The step of the newest complete checkpoint under ``out_dir`` that holds its tree
    metadata, or None (whether its arrays can be read, only reading them tells)."""
    return next((s for s in checkpoint_steps(out_dir) if _tree_metadata(out_dir, s).exists()), None)


def holds_checkpoints(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a checkpoint: a complete one, or one set aside as unreadable
    (a half-written one does not count)."""
    directory = out_dir / CHECKPOINT_DIR
    return bool(checkpoint_steps(out_dir)) or any(directory.glob(f"*{SET_ASIDE_SUFFIX}"))


def restore_model(out_dir: Path, step: int, run: Run, device: Any) -> dict[str, Any]:
    """The parameters (and the model state, when the model has one: the routers' expert
    biases) of the checkpoint of ``step``, alone, as arrays on ``device``: the optimizer
    state is not read. ``{"params": ..., "model_state": ...}`` of pure dicts, in the
    model's layout (the blocks unstacked where ``run`` has a pipeline)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    state = run.state_shapes
    trees = {"params": state.params}
    if jax.tree.leaves(state.model_state):
        trees["model_state"] = state.model_state
    target = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), trees
    )
    path = (out_dir / CHECKPOINT_DIR / str(step) / "state").absolute()
    with ocp.PyTreeCheckpointer() as reader:
        restored = reader.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            ),
        )
    restored = dict(restored)
    restored["params"] = to_layout(restored["params"], run.stages, None)
    return restored


def latest_checkpoint(out_dir: Path) -> int | None:
    """The step of the newest complete checkpoint under ``out_dir``, or None."""
    steps = checkpoint_steps(out_dir)
    return steps[0] if steps else None


def saved_config(out_dir: Path, step: int) -> dict[str, Any]:
    """The configuration (as a dict) that the checkpoint of ``step`` was written under."""
    path = (out_dir / CHECKPOINT_DIR / str(step) / "config").absolute()
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
        return reader.restore(path)


def saved_run(out_dir: Path, step: int) -> dict[str, Any]:
    """Where the run stood at the checkpoint of ``step`` besides its state: the ``run``
    item (:meth:`RunCheckpoints.save`)."""
    path = (out_dir / CHECKPOINT_DIR / str(step) / "run").absolute()
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
        return reader.restore(path)


def check_compatible(saved: dict[str, Any], config: Config, step: int) -> list[str]:
    """Refuse a checkpoint that ``config``'s state cannot be restored from: arrays of other
    shapes or dtypes (a wider model, a shared expert more; a change of compute dtype or of
    recomputation leaves them as they are), or state of another algorithm or layout.

    Returns the fields that differ (``section.field``), which a resumed run may change: the
    layout, the number of steps, the schedule, the compute dtype, ...
    """
    changes = {
        f"{section}.{name}": (saved.get(section, {}).get(name, value), value)
        for section, values in config.to_dict().items()
        for name, value in values.items()
        if saved.get(section, {}).get(name, value) != value
    }
    try:  # a research option that left the section, at another value than the library's
        saved_moe_fields(saved.get("moe", {}))
    except ConfigError as error:
        raise ConfigError(
            f"the checkpoint of step {step} was written under {error}; or start a new run "
            "with --overwrite"
        ) from None
    # The gradient-sync state is part of the train state, shaped by its algorithm (and,
    # for the per-device residuals of int8 and decentralized-int8, by the layout).
    sync_fields = {"train.grad_sync"}
    if config.train.grad_sync in ("int8", "decentralized-int8"):
        sync_fields |= {
            "parallel.data",
            "parallel.expert",
            "parallel.tensor",
            "parallel.context",
            "parallel.expert_tensor",
        }
    # The expert biases of auxiliary-loss-free balancing exist only with a positive rate
    # (a checkpoint written before the field existed has none).
    saved_rate = saved.get("moe", {}).get("expert_bias_rate", 0.0)
    if (saved_rate > 0) != (config.moe.expert_bias_rate > 0):
        held = "holds expert biases" if saved_rate > 0 else "holds no expert biases"
        raise ConfigError(
            f"the checkpoint of step {step} {held} (moe.expert_bias_rate {saved_rate!r} -> "
            f"{config.moe.expert_bias_rate!r}): resume with a rate that is "
            f"{'positive' if saved_rate > 0 else '0'}, or start a new run with --overwrite"
        )
    # The per-device residuals are laid out by the mesh's devices, pipeline stages included.
    if config.train.grad_sync in ("int8", "decentralized-int8"):
        sync_fields |= {"parallel.pipeline", "parallel.virtual_stages"}
    # The placement table is [moe_layers, expert axis, replica slots].
    placement_fields = {"moe.slots_per_device"}
    if config.replica_slots:
        placement_fields |= {"parallel.expert"}
    for fields, what in ((sync_fields, "gradient-sync state"), (placement_fields, "a placement")):
        differ = [
            f"{name} {changes[name][0]!r} -> {changes[name][1]!r}"
            for name in sorted(fields & set(changes))
        ]
        if differ:
            raise ConfigError(
                f"the checkpoint of step {step} holds {what} that does not fit "
                f"({', '.join(differ)}): resume with the saved values, or start a new run with "
                "--overwrite"
            )
    _refuse_another_shape(saved, config, step)
    return sorted(changes)


def _saved_model(saved: dict[str, Any]) -> tuple[ModelConfig, MoEConfig]:
    """The model and MoE sections a checkpoint was written under (a field written before it
    existed at its default, as that run had it)."""

    def section(kind: type, values: dict[str, Any]) -> Any:
        known = {field.name for field in dataclasses.fields(kind)}
        return kind(**{name: value for name, value in values.items() if name in known})

    return (
        section(ModelConfig, saved.get("model", {})),
        section(MoEConfig, saved_moe_fields(saved.get("moe", {}))),
    )


def _held_shapes(model: ModelConfig, moe: MoEConfig, seed: int) -> Any:
    """The shape and dtype of each array a checkpoint holds of the model: its parameters
    (and so their optimizer moments) and its model state (the expert biases)."""
    _, params, model_state = abstract_model(model, moe, seed, DEFAULT, "ring")
    return jax.tree.map(
        lambda leaf: (leaf.shape, jnp.dtype(leaf.dtype)),
        (nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)),
    )


def _refuse_another_shape(saved: dict[str, Any], config: Config, step: int) -> None:
    """Refuse a checkpoint whose model's arrays have other shapes or dtypes than
    ``config``'s would, naming the fields that differ from the saved configuration and,
    of those, the ones that change the arrays alone (all of them, where none does)."""
    try:
        model, moe = _saved_model(saved)
    except ConfigError as error:
        raise ConfigError(
            f"the checkpoint of step {step} was written under {error}; start a new run with "
            "--overwrite"
        ) from None
    differ = {
        f"{name}.{field.name}": (getattr(old, field.name), getattr(new, field.name))
        for name, old, new in (("model", model, config.model), ("moe", moe, config.moe))
        for field in dataclasses.fields(old)
        if getattr(old, field.name) != getattr(new, field.name)
    }
    if not differ:
        return
    seed = config.train.seed
    held = _held_shapes(model, moe, seed)
    if _held_shapes(config.model, config.moe, seed) == held:
        return

    def changes_the_arrays(name: str) -> bool:
        sections = {"model": model, "moe": moe}
        section, field = name.split(".")
        try:
            sections[section] = dataclasses.replace(sections[section], **{field: differ[name][1]})
            return _held_shapes(sections["model"], sections["moe"], seed) != held
        except Exception:  # a model only the other changes make valid: this one counts
            return True

    named = [name for name in differ if changes_the_arrays(name)] or list(differ)
    listed = ", ".join(f"{name} {differ[name][0]!r} -> {differ[name][1]!r}" for name in named)
    raise ConfigError(
        f"the checkpoint of step {step} holds a model of another shape ({listed}): resume "
        "with the saved values, or start a new run with --overwrite"
    )


def error_reason(error: BaseException) -> str:
    """Why reading failed, in one line: the first line of the error that caused the others
    (Orbax wraps TensorStore's; an error raised ``from None`` caused nothing), at most 200
    characters."""
    while True:
        cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if cause is None:
            break
        error = cause
    text = str(error).strip().splitlines()
    reason = text[0] if text else type(error).__name__
    if isinstance(error, json.JSONDecodeError):  # Orbax's metadata files are JSON
        reason = f"a file of it is not valid JSON: {reason}"
    return reason[:200]


# What a save writes beyond its arrays' bytes: Orbax's chunked layout rounds and indexes
# them (up to a tenth more, measured on the small models), and each save adds metadata
# files of a few kilobytes each.
SAVE_HEADROOM = 0.1
SAVE_METADATA_BYTES = 256 * 1024


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say); the message says why."""


@contextlib.contextmanager
def _reporting_write_errors() -> Iterator[None]:
    """Orbax reports a failed write as a ValueError from TensorStore: give it one line."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except (OSError, ValueError) as error:
        text = str(error)
        reason = "no space left on device" if "No space left" in text else text.splitlines()[0]
        raise CheckpointWriteError(f"a checkpoint could not be written: {reason}") from error


class RunCheckpoints:
    """The checkpoints of one run directory: asynchronous saves, the last ``keep`` kept."""

    def __init__(self, out_dir: str | Path, run: Run):
        self.directory = Path(out_dir) / CHECKPOINT_DIR
        self.run = run
        self.config = run.config
        self._manager = _manager(self.directory, keep=run.config.train.keep_checkpoints)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state: TrainState, data: DataPosition | None = None) -> int:
        """Start writing ``state`` (after ``state.step`` steps) and where the input stands
        (``data``; None: after ``state.step`` batches); returns that step.

        Returns once the arrays are copied to the host, so the caller may donate them
        to the next step; the files are written in the background.
        """
        step = int(jax.device_get(state.step))
        position = {} if data is None else data.to_json()
        run = {
            "next_step": step,
            "data": {"seed": self.config.train.seed, **position},
            "rng": {"seed": self.config.train.seed, "router_noise_step": step},
            "processes": jax.process_count(),
        }
        with _reporting_write_errors():
            self._manager.wait_until_finished()  # the previous save is on disk
            self._check_room(step, state)
            self._save(step, state, run)
        return step

    def _check_room(self, step: int, state: TrainState) -> None:
        """Refuse a save that would fill the disk: stopping before it keeps what is there
        whole (a write that runs out of space mid-way fails in Orbax's threads)."""
        arrays = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
        needed = arrays * (1 + SAVE_HEADROOM) + SAVE_METADATA_BYTES
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise CheckpointWriteError(
                f"no space left for the checkpoint of step {step}: {free / 1e6:.1f} MB free, "
                f"it takes about {needed / 1e6:.1f} MB"
            )

    def _save(self, step: int, state: TrainState, run: dict[str, Any]) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
                run=ocp.args.JsonSave(run),
                config=ocp.args.JsonSave(self.config.to_dict()),
            ),
            force=True,
        )

    def restore(self, step: int) -> TrainState:
        """The state saved at ``step``, laid out for the run's mesh and configuration."""
        metadata = _tree_metadata(self.directory.parent, step)
        if not metadata.exists():  # Orbax would say only that the tree does not match
            raise FileNotFoundError(f"its tree metadata ({metadata.name}) is missing")
        current = abstract_sharded_state(self.run)
        layout, saved = self.run.stages, self._saved_layout(step)
        target = current if saved == layout else self._abstract_state_in(saved)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                ),
                run=ocp.args.JsonRestore(),
            ),
        )
        if saved == layout:
            return restored.state
        shardings = jax.tree.map(lambda leaf: leaf.sharding, current)
        return jax.jit(
            lambda state: param_trees_mapped(state, lambda tree: to_layout(tree, saved, layout)),
            out_shardings=shardings,
        )(restored.state)

    def _saved_layout(self, step: int) -> StageLayout | None:
        """The pipeline layout the checkpoint of ``step`` was written in (None: none; a
        checkpoint without its configuration is taken to be in the current one)."""
        if not (self.directory / str(step) / "config").exists():
            return self.run.stages
        parallel = saved_config(self.directory.parent, step).get("parallel", {})
        stages, virtual = parallel.get("pipeline", 1), parallel.get("virtual_stages", 1)
        chunk_layers = parallel.get("chunk_layers")
        counts = None if chunk_layers is None else tuple(map(int, chunk_layers.split(",")))
        return layout_of(stages, virtual, counts, self.config.model.num_layers)

    def _abstract_state_in(self, saved: StageLayout | None) -> TrainState:
        """The current state's shapes moved into the ``saved`` layout, on the run's mesh:
        each stacked array split as the current specs split its layers, and over the
        pipeline axis where the mesh has one."""
        layout, mesh = self.run.stages, self.run.on_mesh
        shapes = jax.eval_shape(
            lambda state: param_trees_mapped(state, lambda tree: to_layout(tree, layout, saved)),
            self.run.state_shapes,
        )
        stage_axis = PIPELINE_AXIS if PIPELINE_AXIS in mesh.axis_names else None
        specs = param_trees_mapped(
            self.run.specs,
            lambda tree: to_layout_specs(tree, layout, saved, stage_axis),
        )
        return jax.tree.map(
            lambda shape, spec: jax.ShapeDtypeStruct(
                shape.shape, shape.dtype, sharding=jax.sharding.NamedSharding(mesh, spec)
            ),
            shapes,
            specs,
            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
        )

    def restore_newest(self) -> tuple[TrainState, int] | None:
        """The newest checkpoint that can be read, laid out for the run's mesh, and its step
        (None without any checkpoint).

        A checkpoint that cannot be read (a truncated data file, missing metadata) is said
        in one line and moved aside to ``<step>.unreadable`` (nothing is deleted), so that
        the run can write that step again; the one before is tried. ConfigError when none
        can be read.
        """
        unreadable: dict[int, str] = {}
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state = self.restore(step)
            except Exception as error:  # whatever Orbax or TensorStore raise for a bad file
                reason = unreadable[step] = error_reason(error)
                if jax.process_index() == 0:
                    print(
                        f"--resume: the checkpoint of step {step} cannot be read ({reason}): "
                        "trying the one before it",
                        flush=True,
                    )
                continue
            self._set_aside(list(unreadable))
            return state, step
        if unreadable:
            reasons = "; ".join(f"step {step} ({why})" for step, why in unreadable.items())
            raise ConfigError(
                f"--resume: no checkpoint in {self.directory} can be read: {reasons}; "
                "start a new run with --overwrite"
            )
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Rename the checkpoints of ``steps`` to ``<step>.unreadable`` (process 0)."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                source = self.directory / str(step)
                target = self.directory / f"{step}{SET_ASIDE_SUFFIX}"
                if source.exists() and not target.exists():
                    source.rename(target)
        self._manager.reload()

    def wait(self) -> None:
        """Block until every save started so far is on disk (raises its error if any)."""
        with _reporting_write_errors():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish the saves in flight and let go of the directory."""
        with _reporting_write_errors():
            self._manager.close()

    def __enter__(self) -> RunCheckpoints:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        try:
            self.close()
        except CheckpointWriteError:
            if exc_type is None:
                raise  # otherwise the error already on its way says what went wrong
