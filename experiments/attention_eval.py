"""The blockwise (flash) attention core against the dense one on 8 CPU devices: step time,
XLA's compiled peak and the process's peak memory, as the sequence grows.

    python -m experiments.attention_eval [--seqs 256,1024,2048,4096] [--tokens 16384]
        [--rounds 5] [--steps 2] [--run-limit-gb 10] [--out FILE]

``mixtral-tiny`` (4 layers, width 128, 4 heads over 2 KV heads, 8 experts top-2,
float32) on the 8 fake CPU devices of this host, at each sequence length with
``--tokens`` tokens a step (at least one sequence per device: 8 sequences of 4096 are
twice the tokens). For each length, in one process of its own:

- both cores' steps compiled, XLA's memory analysis of each (arguments, outputs not
  aliased to the donated state, temporaries: one device's peak), then ``--rounds`` rounds
  of ``--steps`` steps of each core in turn, so that each round's ratio is of two
  measurements taken side by side;
- and, each core in a process of its own, the process's peak resident memory
  (``ru_maxrss``) over compiling and running ``--steps`` steps: the figure the issue's
  target names (seq 2048 x 8 within 1.5 times seq 256 x 64).

A core whose compiled peak over the 8 devices exceeds ``--run-limit-gb`` is compiled but
not run (the dense core's scores at 4096 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.shared.compiled_memory import compiled_peak
from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios

RESULTS = Path(__file__).parent / "results" / "attention_eval.md"
CORES = ("dense", "blockwise")
DEVICES = 8


def _config(seq: int, tokens: int, core: str) -> Any:
    from jaxmoe.presets import preset

    config = preset("mixtral-tiny")
    batch = max(DEVICES, tokens // seq)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, seq_len=seq, attention=core),
        train=dataclasses.replace(config.train, batch_size=batch),
    )


def _compiled(config: Any) -> tuple[Any, Any, Any, int]:
    """The mesh, the compiled step, its initial state and XLA's per-device peak."""
    from jaxmoe.parallel.mesh import build_mesh
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import scheduled_train_step
    from jaxmoe.train.state import init_train_state

    mesh = build_mesh(config.parallel)
    run = resolve(config, mesh)
    step = scheduled_train_step(run).compile()
    analysis = step.memory_analysis()
    return mesh, step, init_train_state(run), compiled_peak(analysis)


def _batch(config: Any, mesh: Any, rng: Any) -> Any:
    """``[batch, seq_len + 1]`` random byte tokens, sharded over the token axes."""
    import jax
    import numpy as np

    from jaxmoe.parallel.mesh import token_spec

    rows = rng.integers(0, 256, (config.train.batch_size, config.model.seq_len + 1))
    sharding = jax.sharding.NamedSharding(mesh, token_spec(mesh))
    return jax.device_put(rows.astype(np.int32), sharding)


def child_times(seq: int, args: argparse.Namespace) -> dict[str, Any]:
    """Both cores at one length: compiled peaks, and the rounds' step times."""
    import jax
    import numpy as np

    built, result = {}, {"seq": seq, "peak": {}, "seconds": {c: [] for c in CORES}}
    for core in CORES:
        config = _config(seq, args.tokens, core)
        mesh, step, state, peak = _compiled(config)
        result["peak"][core] = peak
        result["batch"] = config.train.batch_size
        if peak * DEVICES <= args.run_limit_gb * 1e9:
            built[core] = (config, mesh, step, state)
    rng = np.random.default_rng(0)
    for _ in range(args.rounds):
        for core, (config, mesh, step, state) in built.items():
            batch = _batch(config, mesh, rng)
            state, metrics = step(state, batch)  # the round's first step: untimed
            jax.block_until_ready(metrics)
            began = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            result["seconds"][core].append((time.perf_counter() - began) / args.steps)
            built[core] = (config, mesh, step, state)
    return result


def child_rss(seq: int, core: str, args: argparse.Namespace) -> dict[str, Any]:
    """One core at one length in this process: its peak resident memory."""
    import jax
    import numpy as np

    config = _config(seq, args.tokens, core)
    mesh, step, state, peak = _compiled(config)
    ran = peak * DEVICES <= args.run_limit_gb * 1e9
    if ran:
        batch = _batch(config, mesh, np.random.default_rng(0))
        for _ in range(args.steps):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seq": seq, "core": core, "rss": rss, "ran": ran}


def _in_child(extra: list[str], argv: list[str]) -> dict[str, Any]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = f"--xla_force_host_platform_device_count={DEVICES}"
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), flags]).strip()
    done = subprocess.run(
        [sys.executable, "-m", "experiments.attention_eval", *argv, *extra],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(times: list[dict], rss: list[dict], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# Blockwise (flash) attention against the dense core on 8 CPU devices",
        "",
        f"    {command}",
        "",
        f"`mixtral-tiny` (4 layers, width 128, 4 heads over 2 KV heads, 8 experts top-2, "
        f"float32) on 8 fake CPU devices of a 2-core host shared with other work, "
        f"{args.tokens} tokens a step "
        f"(at least one sequence per device), blockwise tiles of 512. Step time: "
        f"{args.rounds} rounds of {args.steps} steps of each core in turn, after an "
        "untimed step; median [min-max]; the ratio per round. XLA peak: the compiled "
        "step's memory analysis, one device. Process peak: ru_maxrss of a process that "
        "compiles one core's step and runs it (all 8 devices).",
        "",
        "| seq x batch | dense ms | blockwise ms | blockwise / dense | dense XLA peak MB | "
        "blockwise XLA peak MB | dense process GB | blockwise process GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["seq"], r["core"]): r for r in rss}
    for row in times:
        seq, seconds = row["seq"], row["seconds"]
        dense, block = seconds["dense"], seconds["blockwise"]
        ratio = Spread.of(round_ratios(block, dense)).format(1, 2) if dense else "not run"
        cells = [
            f"{seq} x {row['batch']}",
            Spread.of(dense).format() if dense else "not run",
            Spread.of(block).format(),
            ratio,
            f"{row['peak']['dense'] / 1e6:.1f}",
            f"{row['peak']['blockwise'] / 1e6:.1f}",
        ]
        for core in CORES:
            found = by.get((seq, core))
            cells.append(
                f"{found['rss'] / 1e9:.2f}" + ("" if found["ran"] else " (compiled only)")
                if found
                else ""
            )
        lines.append("| " + " | ".join(cells) + " |")
    low, high = min(r["seq"] for r in times), 2048
    for core in CORES:
        a, b = by.get((low, core)), by.get((high, core))
        if a and b and a["ran"] and b["ran"]:
            lines.append(
                f"\n{core}: process peak at {high} tokens a sequence is "
                f"{b['rss'] / a['rss']:.2f} times that at {low} (the target: at most 1.5 for "
                "the blockwise core)."
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="256,1024,2048,4096")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--run-limit-gb", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child-times", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-rss", nargs=2, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.child_times:
        print(json.dumps(child_times(args.child_times, args)))
        return 0
    if args.child_rss:
        print(json.dumps(child_rss(int(args.child_rss[0]), args.child_rss[1], args)))
        return 0
    shared = [
        "--tokens", str(args.tokens), "--rounds", str(args.rounds), "--steps",
        str(args.steps), "--run-limit-gb", str(args.run_limit_gb),
    ]  # fmt: skip
    seqs = [int(s) for s in args.seqs.split(",")]
    times, rss = [], []
    for seq in seqs:
        times.append(_in_child(["--child-times", str(seq)], shared))
        print(json.dumps(times[-1]), flush=True)
        for core in CORES:
            rss.append(_in_child(["--child-rss", str(seq), core], shared))
            print(json.dumps(rss[-1]), flush=True)
    text = render(times, rss, args, command_line("experiments.attention_eval", argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"times": times, "rss": rss}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
