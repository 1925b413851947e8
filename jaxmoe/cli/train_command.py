"""``jaxmoe train``: one process of a run, from the command line to its last step.

Before anything starts: the flags that are not configuration fields and the run
directory are checked (``--out``, cleared for ``--overwrite``), and a ``--resume`` of a
run that has its steps already ends there, told by its checkpoints' steps alone. Then
the distributed runtime starts, the run is prepared once (:func:`jaxmoe.prepare.prepare_run`: the
mesh, every automatic choice), the checkpoint to resume from is found, and the loop
trains.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from jaxmoe.config import Config, ConfigError
from jaxmoe.parallel.distributed import DistributedConfig


def distributed_config(args: argparse.Namespace) -> DistributedConfig:
    """This process's place in a multi-process run, from its flags (checked)."""
    return DistributedConfig(
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        auto=args.distributed == "auto",
        heartbeat_timeout_s=args.heartbeat_timeout,
    )


def check_train_flags(args: argparse.Namespace) -> None:
    """The ``jaxmoe train`` flags that are not configuration fields."""
    timeout = args.step_timeout
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"--step-timeout {timeout:g}: must be a number of seconds > 0")
    distributed_config(args)  # checks --heartbeat-timeout and the cluster flags


def _checkpoint_bytes(config: Config) -> int:
    """Bytes of one checkpoint: the whole train state (shapes only, nothing allocated)."""
    import jax

    from jaxmoe.train.resolved import resolve

    leaves = jax.tree.leaves(resolve(config).state_shapes)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def _prepare_out(args: argparse.Namespace, distributed: DistributedConfig) -> None:
    """Check ``--out`` (and clear it for ``--overwrite``) before JAX starts."""
    from jaxmoe.cli.run_dir import prepare_run_dir

    if args.out is None:
        if args.resume or args.overwrite:
            raise ConfigError("--resume and --overwrite need --out, the run's directory")
        return
    prepare_run_dir(
        args.out,
        resume=args.resume,
        overwrite=args.overwrite,
        primary=distributed.process_index_hint() == 0,
    )


def _finished(config: Config, args: argparse.Namespace) -> bool:
    """Whether ``--resume`` continues a run whose newest checkpoint (with its tree metadata)
    has ``train.steps`` steps already: read from the checkpoint directory, with nothing
    built or compiled."""
    from jaxmoe.train.checkpoint import newest_described

    if not args.resume or args.out is None:
        return False
    newest = newest_described(Path(args.out))
    return newest is not None and newest >= config.train.steps


def _resume_point(config: Config, args: argparse.Namespace) -> int | None:
    """Room for a checkpoint, and the checkpoint to resume from (after JAX starts)."""
    import jax

    from jaxmoe.cli.run_dir import check_free_space, resume_point

    if args.out is None:
        return None
    check_free_space(args.out, _checkpoint_bytes(config))
    if not args.resume:
        return None
    start = resume_point(args.out, config)
    if jax.process_index() == 0:
        if start.resume_step is None:
            print(f"--resume: no checkpoint in {args.out}: starting a new run", flush=True)
        elif start.changed_fields:
            print(
                f"--resume: continuing the checkpoint of step {start.resume_step} with other "
                f"values of {', '.join(start.changed_fields)}",
                flush=True,
            )
    return start.resume_step


def run(config: Config, args: argparse.Namespace) -> int:
    import jax

    from jaxmoe.plan.host_memory import check_host_memory
    from jaxmoe.prepare import start_process
    from jaxmoe.train.failed_saves import quiet_failed_saves
    from jaxmoe.train.logs.profiler import parse_profile_steps
    from jaxmoe.train.loop import RunStopped, train
    from jaxmoe.train.run_control import StopSignals

    profile = args.profile_steps
    if profile is not None:  # checked before anything starts or compiles
        profile = parse_profile_steps(profile, config.train.steps, args.out)

    # A failed checkpoint write is the run's one line, not Orbax's tracebacks as well.
    quiet_failed_saves()
    distributed = distributed_config(args)
    _prepare_out(args, distributed)
    if _finished(config, args):
        if distributed.process_index_hint() == 0:
            print(f"done: the run already has its {config.train.steps} steps")
        return 0
    step_timeout = args.step_timeout
    if step_timeout is None and distributed.enabled:
        step_timeout = 120.0
    # From here on a signal ends the run promptly, whatever stage it is in.
    with StopSignals(multi_process=distributed.enabled) as signals:
        # Before the resume check: a checkpoint's gradient-sync state fits one algorithm.
        prepared = start_process(config, distributed)
        check_host_memory(prepared.config)
        resume_step = _resume_point(prepared.config, args)
        try:
            rows = train(
                prepared,
                args.out,
                progress=not args.no_progress,
                step_timeout_s=step_timeout,
                resume=resume_step is not None,
                profile_steps=profile,
                signals=signals,
            )
        except RunStopped as stopped:
            if jax.process_index() == 0:
                print(f"jaxmoe train: {stopped}", file=sys.stderr, flush=True)
            return stopped.status
    if jax.process_index() != 0:
        return 0
    if not rows:
        print(f"done: the run already has its {config.train.steps} steps")
        return 0
    last = rows[-1]
    print(
        f"done: {last['step'] + 1} steps ({len(rows)} in this run), "
        f"loss {rows[0]['loss']:.3f} -> {last['loss']:.3f}, "
        f"val_loss {last.get('val_loss', float('nan')):.3f}"
    )
    return 0
