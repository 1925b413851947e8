"""What periodic checkpoints cost a training run: the same run with and without them.

    python -m experiments.checkpoint_overhead [--preset tiny] [--repeats 3]

Runs the preset's whole training (its ``train.steps``) in this process, alternately
without checkpoints (no run directory) and with them at the default interval
(``train.checkpoint_every``, plus the one at the end, which is waited for), in
rounds whose order flips each round so that drift hits both alike. A run's time is
its training loop: the sum over steps of the step time (to completion) and the time
the step's checkpoint held training up (the copy off the devices, and the final
wait); compilation and validation are left out of both. Writes
``experiments/results/checkpoint_overhead.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "checkpoint_overhead.md"


def _loop_seconds(rows: list[dict]) -> float:
    return sum(row["step_time_s"] + row.get("checkpoint_s", 0.0) for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from jaxmoe.parallel.distributed import DistributedConfig
    from jaxmoe.prepare import start_process
    from jaxmoe.presets import preset

    prepared = start_process(preset(args.preset), DistributedConfig())
    config = prepared.config

    import jax

    from jaxmoe.train.loop import train

    variants = ("no checkpoints", f"every {config.train.checkpoint_every} steps")
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    saves = 0
    for round_index in range(args.repeats):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for name in order:
            with tempfile.TemporaryDirectory() as scratch:
                out = None if name == variants[0] else Path(scratch) / "run"
                rows = train(prepared, out, progress=False)
                if out is not None:
                    saves = len(list((out / "checkpoints").iterdir()))
            seconds[name].append(_loop_seconds(rows))
            print(f"round {round_index + 1}: {name}: {seconds[name][-1]:.2f} s", flush=True)

    base, saved = (seconds[name] for name in variants)
    ratios = [with_ / without for with_, without in zip(saved, base, strict=True)]
    overhead = 100 * (statistics.median(ratios) - 1)
    lines = [
        "# Checkpoint overhead",
        "",
        f"Command: `python -m experiments.checkpoint_overhead --preset {args.preset} "
        f"--repeats {args.repeats}`",
        "",
        f"Machine: {platform.machine()}, {jax.device_count()} {jax.default_backend()} devices, "
        f"jax {jax.__version__}, Python {sys.version.split()[0]}.",
        "",
        f"Preset `{args.preset}`: {config.train.steps} steps; checkpoints every "
        f"{config.train.checkpoint_every} steps and at the end ({saves} kept, "
        f"{config.train.keep_checkpoints} at most), written asynchronously with Orbax.",
        "",
        "| run | median loop (s) | min (s) | max (s) |",
        "|---|---|---|---|",
        *(
            f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |"
            for name, times in seconds.items()
        ),
        "",
        f"Overhead of checkpoints: {overhead:+.1f}% (median of the per-round ratios; "
        f"rounds: {', '.join(f'{100 * (ratio - 1):+.1f}%' for ratio in ratios)}).",
        "",
        "A run's loop time is the sum of its step times (each to completion) and the time "
        "its checkpoints held training up; compilation and validation are left out of both. "
        "The rounds alternate which run goes first.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
