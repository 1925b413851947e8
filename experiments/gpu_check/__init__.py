"""The project's open GPU questions, answered in one run on one GPU (under 8 minutes).

    python -m experiments.gpu_check [--out DIR] [--sections attention,gemm,fp8,step,schedule]
        [--dry]

Five sections, each in its own time limit; one that fails or runs out of time is
recorded with its error, and the others still run:

- **attention**: the attention cores (:mod:`jaxmoe.layers.attention_core`) at Mixtral's
  shapes (batch 1, 4096 tokens, 32 query heads over 8 key/value heads of 128, bfloat16,
  causal), without and with packed documents (segment ids): cuDNN's flash attention
  where :func:`~jaxmoe.layers.attention_core.cudnn_takes` allows it, blockwise at blocks
  of 512 and 1024, dense below a size of its scores. Each core's output and its ``dq``,
  ``dk``, ``dv`` (``jax.vjp`` with one fixed random cotangent) against the dense core in
  float32 at the highest matmul precision (largest absolute difference); forward plus
  backward timed, the cores round-robin, so that each ratio to cuDNN is of two
  measurements taken side by side. And how many of a flash core's forward passes the
  backward pass runs again under ``model.recompute matmuls``'s policy (0 where the policy
  keeps its residuals, as it keeps cuDNN's by its forward primitive).
- **gemm**: bfloat16 matmuls, square (1024 to 8192) and two MoE expert shapes (tokens x
  d_model @ d_model x d_ff): TFLOP/s and the fraction of the device's dense datasheet
  peak (:func:`jaxmoe.plan.mfu.datasheet_peak_tflops`); the same products with
  ``float8_e4m3fn`` operands accumulated in float32, their ratio to bfloat16 (timed
  round-robin with it), whether the compiled module holds an FP8 GEMM, and the FP8
  product's largest error relative to the bfloat16 one. Each call runs a chain of
  dependent products (``x @ up @ down``, repeated) inside one program, and each
  measurement queues calls enough for about 20 TFLOP, so that small sizes are not timed
  as dispatches.
- **fp8**: one expert block (:class:`~jaxmoe.layers.experts.Experts`, SwiGLU, Mixtral
  8x7B's widths, its 8 experts' slots of 2048 tokens each, bfloat16) forward and
  backward, its GEMMs as ``model.fp8`` none (bfloat16), tensorwise and blockwise run them
  (:mod:`jaxmoe.layers.fp8`), timed round-robin: each recipe's time and its ratio to
  bfloat16, and whether the compiled module holds an FP8 GEMM.
- **step**: one training step on one device (parallel data 1 x expert 1) of Mixtral
  8x7B cut to two blocks (the ``mixtral-8x7b`` preset: d_model 4096, d_ff 14336, 32 query
  heads over 8, 8 experts top-2, 4096 tokens a row, bfloat16, ``model.attention`` auto),
  its batch the largest that the memory walk (:func:`jaxmoe.plan.memory.step_memory`, at
  each candidate batch) fits in 80 GB: median step time, tokens/s, MFU (model FLOPs of
  :func:`jaxmoe.plan.model_flops.model_flops` over the datasheet peak), and the cost
  model's estimate (``scheduling.cost_model`` with the ``h100-8x-nvlink-3200g`` profile,
  summed over the captured per-device program's ops) against it, for the whole step and
  for one block (the ops under ``layer_<i>``), the measured block from a ``jax.profiler``
  trace of two steps (the device time of the executed ops whose op_name names that
  layer; step time over layers where the trace cannot be read). And the compiled step's
  memory (XLA's ``memory_analysis``: arguments + outputs - aliased + temporaries) against
  the memory walk's estimate, with the device allocator's limit and its peak in use after
  the timed steps: what of the device's memory a step can have, the planner's capacity.
- **schedule**: :mod:`experiments.gpu_schedule_check` on JAX's mock topology of 8 GPUs
  (``none``, ``lancet``, ``pair``: windows kept, all-to-alls overlapped, step times). It
  runs in a process of its own: the mock topology must be chosen before JAX starts its
  backends, and this process's has started.

Writes ``DIR/gpu_check.json`` (every section, the jax version, the device, the command)
and ``DIR/gpu_check.md`` after each section, so that a run cut short keeps what it
measured. A run of some sections (``--sections``) replaces those in DIR's files and keeps
the others that a run on the same kind of device wrote there; each section records the
run it came from (its command, jax version, XLA flags and date). The GPU's memory is
allocated as needed (``XLA_PYTHON_CLIENT_PREALLOCATE`` false unless set), so that the
schedule section's process finds room on it.

``--dry`` runs every section on a CPU device at tiny shapes (seconds; float32, one round)
to try the code paths; its files say so in their first line, hold no GPU figures and go
by default to ``experiments/results/gpu_check/dry/``, leaving a GPU run's files alone.
Without ``--dry`` the script refuses to run where no GPU is visible, and runs under the
XLA flags that a run with ``model.fp8`` sets
(:data:`jaxmoe.parallel.host_devices.FP8_XLA_GPU_FLAGS`: cuBLASLt, not Triton, for GEMMs)
unless XLA_FLAGS names them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from experiments.gpu_check import attention, fp8, gemm, schedule, step
from experiments.gpu_check.setup import (
    DRY,
    GPU,
    RESULTS,
    ROOT,
    TOTAL_S,
    Budget,
    SectionTimeout,
    Setup,
    error_text,
)
from experiments.shared.results_file import command_line
from jaxmoe.parallel.host_devices import FP8_XLA_GPU_FLAGS, ensure_xla_flags

SECTION_MODULES = {
    "attention": attention,
    "gemm": gemm,
    "fp8": fp8,
    "step": step,
    "schedule": schedule,
}
SECTIONS = tuple(SECTION_MODULES)
SECTION_FUNCTIONS = {name: module.measure for name, module in SECTION_MODULES.items()}
REPORTERS = {name: module.report for name, module in SECTION_MODULES.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help=f"default {RESULTS.relative_to(ROOT)}"
    )
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--dry", action="store_true", help="tiny shapes on a CPU device")
    args = parser.parse_args(argv)
    chosen = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    if not args.dry:
        # The schedule section's process shares the GPU: allocate only what is used.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # The flags a run with model.fp8 sets, so that FP8 products compile as they do
        # there (with Triton's GEMMs on, one FP8 expert block compiled for minutes).
        ensure_xla_flags(list(FP8_XLA_GPU_FLAGS))

    import jax

    if not args.dry and jax.devices()[0].platform != "gpu":
        print(
            f"gpu_check needs a GPU, and found {jax.devices()[0].platform}: --dry tries it on CPU"
        )
        return 2
    out = args.out or (RESULTS / "dry" if args.dry else RESULTS)
    setup = Setup(args.dry, DRY if args.dry else GPU, out, jax.devices()[0])
    command = command_line("experiments.gpu_check", sys.argv[1:] if argv is None else argv)
    results = _header(setup, command)
    results["sections"] = _kept_sections(setup.out / "gpu_check.json", results, chosen)
    started = time.monotonic()
    for name in chosen:
        limit = min(setup.sizes.limits[name], started + TOTAL_S - time.monotonic())
        found = _run_section(name, SECTION_FUNCTIONS[name], setup, limit)
        results["sections"][name] = {**found, "run": _run_of(results)}
        _write(setup, results)
    print((setup.out / "gpu_check.md").read_text())
    return 0


def _header(setup: Setup, command: str) -> dict[str, Any]:
    import jax

    return {
        "dry": setup.dry,
        "note": "dry run: tiny shapes on a CPU device, no GPU figures" if setup.dry else "one GPU",
        "command": command,
        "jax": jax.__version__,
        "platform": setup.device.platform,
        "device_kind": setup.device.device_kind,
        "devices": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "date": datetime.date.today().isoformat(),
        "sections": {},
    }


def _run_of(header: dict[str, Any]) -> dict[str, Any]:
    """What a section records of the run that measured it."""
    return {key: header[key] for key in ("command", "jax", "xla_flags", "date")}


def _kept_sections(
    path: Path, header: dict[str, Any], chosen: list[str]
) -> dict[str, dict[str, Any]]:
    """The sections of an earlier run's file at ``path`` that this run does not measure,
    when that run was on the same kind of device (and as dry as this one); each with its
    run (a file written before sections recorded theirs: that file's own)."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if (earlier.get("dry"), earlier.get("device_kind")) != (header["dry"], header["device_kind"]):
        return {}
    return {
        name: {**found, "run": found.get("run") or _run_of({"date": None, **earlier})}
        for name, found in earlier.get("sections", {}).items()
        if name in SECTIONS and name not in chosen
    }


def _run_section(name: str, function: Callable, setup: Setup, limit: float) -> dict[str, Any]:
    """``function(setup, budget, found)``, its partial ``found`` kept on an error or when it
    runs past ``limit`` seconds; with its wall time."""
    found: dict[str, Any] = {"limit_s": round(limit, 1)}
    began = time.monotonic()
    try:
        if limit <= 0:
            raise SectionTimeout("no time left in the run")
        with _time_limit(limit):
            function(setup, Budget(began + limit), found)
    except Exception as error:  # a section's failure is a finding; the others still run
        found["error"] = error_text(error)
        print(f"{name}: {found['error']}", flush=True)
    found["seconds"] = round(time.monotonic() - began, 2)
    return found


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in the main thread after ``seconds`` (when control
    next returns to Python: a compilation in progress is not interrupted)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"ran past its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _write(setup: Setup, results: dict[str, Any]) -> None:
    """Both files, their sections in the check's order (kept ones and new alike)."""
    sections = results["sections"]
    results = {**results, "sections": {n: sections[n] for n in SECTIONS if n in sections}}
    setup.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=1, default=_json_default)
    # The first key on the first line, so that a dry run's file says so there.
    (setup.out / "gpu_check.json").write_text("{" + text.removeprefix("{\n "))
    (setup.out / "gpu_check.md").write_text(_report(results))


def _json_default(value: Any) -> Any:
    """NumPy's scalars as numbers; anything else as its text."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def _report(results: dict[str, Any]) -> str:
    title = "# GPU check"
    if results["dry"]:
        title += ": DRY RUN on CPU, tiny shapes, no GPU figures"
    lines = [
        title,
        "",
        f"Command (the latest run): `{results['command']}`",
        "",
        f"{results['devices']} x {results['device_kind']} ({results['platform']}), "
        f"jax {results['jax']}, XLA flags `{results['xla_flags']}`.",
        "",
    ]
    latest = _run_of(results)
    for name, found in results["sections"].items():
        lines += [f"## {name}", ""]
        run = found.get("run", latest)
        if run != latest:
            lines += [
                f"From an earlier run: `{run['command']}`, jax {run['jax']}, XLA flags "
                f"`{run['xla_flags']}`" + (f", {run['date']}." if run["date"] else "."),
                "",
            ]
        if "error" in found:
            lines += [f"Error: `{found['error'].splitlines()[0]}`", ""]
        lines += REPORTERS[name](found)
        lines += [f"({found['seconds']:.1f} s of a {found['limit_s']:.0f} s limit.)", ""]
    return "\n".join(lines)
