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
  measurements taken side by side.
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
- **step**: one training step on one device (parallel data 1 x expert 1) of a
  Mixtral-style model (the ``mixtral-8x7b`` preset at d_model 2048, 8 layers, d_ff 4096,
  8 experts top-2, 4096 tokens a row, bfloat16, ``model.attention`` auto), its batch
  the largest that the memory walk (:func:`jaxmoe.plan.memory.step_memory`, extrapolated
  from batches of 1 and 2) fits in 60 GB: median step time, tokens/s, MFU (model FLOPs of
  :func:`jaxmoe.plan.model_flops.model_flops` over the datasheet peak), and the cost
  model's estimate (``scheduling.cost_model`` with the ``h100-8x-nvlink-3200g`` profile,
  summed over the captured per-device program's ops) against it, for the whole step and
  for one block (the ops under ``layer_<i>``), the measured block taken as step time over
  layers.
- **schedule**: :mod:`experiments.gpu_schedule_check` on JAX's mock topology of 8 GPUs
  (``none``, ``lancet``, ``pair``: windows kept, all-to-alls overlapped, step times). It
  runs in a process of its own: the mock topology must be chosen before JAX starts its
  backends, and this process's has started.

Writes ``DIR/gpu_check.json`` (every section, the jax version, the device, the command)
and ``DIR/gpu_check.md`` after each section, so that a run cut short keeps what it
measured. The GPU's memory is allocated as needed (``XLA_PYTHON_CLIENT_PREALLOCATE``
false unless set), so that the schedule section's process finds room on it.

``--dry`` runs every section on a CPU device at tiny shapes (seconds; float32, one round)
to try the code paths; its files say so in their first line, hold no GPU figures and go
by default to ``experiments/results/gpu_check/dry/``, leaving a GPU run's files alone.
Without ``--dry`` the script refuses to run where no GPU is visible.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "gpu_check"
SECTIONS = ("attention", "gemm", "fp8", "step", "schedule")
TOTAL_S = 430  # the whole run, startup aside, within 8 minutes
STEP_PROFILE = "h100-8x-nvlink-3200g"
SCHEDULE_ARGS = (
    "--mock-devices", "8", "--layers", "2", "--schedules", "none,lancet,pair",
    "--steps", "3", "--rounds", "2",
)  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """The shapes and repeats of a run: the GPU's, or the dry run's tiny ones."""

    limits: dict[str, float]  # seconds per section
    # attention: batch, sequence, query heads, key/value heads, head width; dtype; tiles
    attention: tuple[int, int, int, int, int]
    attention_dtype: str
    blocks: tuple[int, ...]
    dense_max_score_bytes: int  # dense core (and the reference) only below this
    rounds: int
    repeats: int  # calls per core per round
    # gemm: (m, k, n) products, and the FLOPs one call aims at
    gemms: tuple[tuple[int, int, int], ...]
    gemm_call_flops: float
    gemm_measure_flops: float  # calls per measurement, queued, to take at least this
    gemm_rounds: int
    # fp8: one expert block's (experts, tokens a slot, d_model, hidden width)
    expert_block: tuple[int, int, int, int]
    # step
    step_preset: str
    step_model: dict[str, Any]
    step_batches: tuple[int, ...]  # candidates, the largest that fits is taken
    step_memory_bytes: float
    step_batch_unwalked: int  # the batch where the memory walk fails
    warmup: int
    steps: int


GPU = Sizes(
    limits={"attention": 90, "gemm": 60, "fp8": 40, "step": 110, "schedule": 130},
    attention=(1, 4096, 32, 8, 128),
    attention_dtype="bfloat16",
    blocks=(512, 1024),
    dense_max_score_bytes=4 << 30,
    rounds=10,
    repeats=3,
    gemms=(
        (1024, 1024, 1024),
        (2048, 2048, 2048),
        (4096, 4096, 4096),
        (8192, 8192, 8192),
        (4096, 4096, 14336),
        (16384, 6144, 16384),
    ),
    gemm_call_flops=4e12,
    gemm_measure_flops=2e13,
    gemm_rounds=7,
    expert_block=(8, 2048, 4096, 14336),
    step_preset="mixtral-8x7b",
    step_model=dict(d_model=2048, num_layers=8, d_ff=4096, seq_len=4096, attention="auto"),
    step_batches=(1, 2, 4, 8, 16, 32),
    step_memory_bytes=60e9,
    step_batch_unwalked=4,  # the walk's 48 GB on a CPU host (the blockwise core)
    warmup=2,
    steps=10,
)
DRY = Sizes(
    limits={"attention": 60, "gemm": 30, "fp8": 30, "step": 60, "schedule": 5},
    attention=(1, 64, 4, 2, 16),
    attention_dtype="float32",
    blocks=(16, 32),
    dense_max_score_bytes=1 << 20,
    rounds=1,
    repeats=1,
    gemms=((64, 64, 64), (128, 128, 128), (64, 128, 256)),
    gemm_call_flops=1e6,
    gemm_measure_flops=1e6,
    gemm_rounds=1,
    expert_block=(2, 16, 32, 64),
    step_preset="tiny",
    step_model=dict(num_layers=2, seq_len=32, attention="auto"),
    step_batches=(1, 2),
    step_memory_bytes=1e9,
    step_batch_unwalked=2,
    warmup=1,
    steps=2,
)


class SectionTimeout(Exception):
    """A section ran past its time limit."""


@dataclass
class Budget:
    """A section's time: its deadline, and whether something of ``seconds`` still fits."""

    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return self.left() > seconds


@dataclass(frozen=True)
class Setup:
    """What every section runs with."""

    dry: bool
    sizes: Sizes
    out: Path
    device: Any  # the one device every section runs on


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
    started = time.monotonic()
    for name in chosen:
        limit = min(setup.sizes.limits[name], started + TOTAL_S - time.monotonic())
        results["sections"][name] = _run_section(SECTION_FUNCTIONS[name], setup, limit)
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
        "sections": {},
    }


def _run_section(function: Callable, setup: Setup, limit: float) -> dict[str, Any]:
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
        found["error"] = _error_text(error)
        print(f"{function.__name__}: {found['error']}", flush=True)
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


def _error_text(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(error)).strip()[:2000]


def _spread(values: Sequence[float]) -> dict[str, Any]:
    spread = Spread.of(values)
    return {"median": spread.median, "low": spread.low, "high": spread.high, "values": values}


def _as_spread(found: dict[str, Any]) -> Spread:
    return Spread(found["median"], found["low"], found["high"])


# -- attention -----------------------------------------------------------------------------


def attention(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """The attention cores against the float32 dense core, and their fwd+bwd times."""
    import jax.numpy as jnp

    from jaxmoe.layers.attention_core import cudnn_takes, resolve_core

    sizes = setup.sizes
    batch, length, heads, kv_heads, head_dim = sizes.attention
    dtype = jnp.dtype(sizes.attention_dtype)
    found.update(
        shape=dict(batch=batch, seq=length, heads=heads, kv_heads=kv_heads, head_dim=head_dim),
        dtype=dtype.name,
        causal=True,
        auto=resolve_core("auto", dtype=dtype, head_dim=head_dim).kind,
        cudnn_refusal=cudnn_takes(dtype, head_dim),
        rounds=sizes.rounds,
        repeats=sizes.repeats,
        variants={},
    )
    operands = _attention_operands(sizes.attention, dtype)
    packed = jnp.asarray(_segment_ids(batch, length))
    for variant, segments in (("causal", None), ("packed", packed)):
        found["variants"][variant] = entry = {}
        if segments is not None:
            entry["documents"] = int(segments.max()) + 1
        _attention_variant(setup, budget, operands, segments, entry)
    return found


def _attention_operands(shape: tuple[int, ...], dtype: Any) -> tuple[Any, ...]:
    """Query, key, value and a cotangent of the output, random and fixed."""
    import jax

    batch, length, heads, kv_heads, head_dim = shape
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [
        (batch, length, heads, head_dim),
        (batch, length, kv_heads, head_dim),
        (batch, length, kv_heads, head_dim),
        (batch, length, heads, head_dim),
    ]
    return tuple(
        jax.random.normal(key, s, jax.numpy.float32).astype(dtype)
        for key, s in zip(keys, shapes, strict=True)
    )


def _segment_ids(batch: int, length: int) -> Any:
    """Packed documents: each row cut at fixed fractions of its length into 5 documents."""
    import numpy as np

    cuts = np.array([0.13, 0.37, 0.5, 0.81]) * length
    ids = np.searchsorted(cuts.astype(int), np.arange(length), side="right")
    return np.broadcast_to(ids, (batch, length)).astype(np.int32)


def _cores(setup: Setup, refusal: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The cores to run by name, and those left out with why."""
    from jaxmoe.layers.attention_core import AttentionCore

    sizes = setup.sizes
    cores, skipped = {}, {}
    if refusal is None:
        cores["cudnn"] = AttentionCore("cudnn")
    else:
        skipped["cudnn"] = refusal
    for block in sizes.blocks:
        cores[f"blockwise_{block}"] = AttentionCore("blockwise", block=block)
    batch, length, heads, _, _ = sizes.attention
    scores = batch * heads * length * length * 4
    if scores <= sizes.dense_max_score_bytes:
        cores["dense"] = AttentionCore("dense")
    else:
        skipped["dense"] = (
            f"its float32 scores take {scores / 2**30:.1f} GiB, over the "
            f"{sizes.dense_max_score_bytes / 2**30:.1f} GiB this check allows"
        )
    return cores, skipped


def _fwd_bwd(core: Any) -> Callable:
    """``(q, k, v, cotangent, segment_ids) -> (out, dq, dk, dv)``, jit-wrapped."""
    import jax

    def run(query, key, value, cotangent, segment_ids):
        def attend(q, k, v):
            return core(q, k, v, segment_ids=segment_ids)

        out, pullback = jax.vjp(attend, query, key, value)
        return (out, *pullback(cotangent))

    return jax.jit(run)


def _attention_variant(
    setup: Setup, budget: Budget, operands: tuple, segments: Any, entry: dict[str, Any]
) -> None:
    import jax
    import jax.numpy as jnp

    from jaxmoe.layers.attention_core import AttentionCore, cudnn_takes

    sizes = setup.sizes
    cores, skipped = _cores(setup, cudnn_takes(operands[0].dtype, operands[0].shape[-1]))
    entry["skipped"] = skipped
    entry["cores"] = results = {}
    reference = None
    if "dense" in cores:  # the dense core fits: so does its float32 run
        try:
            with jax.default_matmul_precision("highest"):
                wide = [x.astype(jnp.float32) for x in operands]
                reference = _fwd_bwd(AttentionCore("dense"))(*wide, segments)
                jax.block_until_ready(reference)
        except Exception as error:  # then the cores are timed, not compared
            entry["reference_error"] = _error_text(error)
    entry["reference"] = "dense core in float32, highest precision" if reference else None
    compiled = {}
    for name, core in cores.items():
        results[name] = result = {}
        if not budget.fits(10):
            result["error"] = "not run: the section's time ran out"
            continue
        try:
            compiled[name] = _compile_core(core, operands, segments, reference, result)
        except Exception as error:  # a core that cannot run here is a finding
            result["error"] = _error_text(error)
    _time_cores(compiled, (*operands, segments), sizes, budget, results)
    baseline = "cudnn" if results.get("cudnn", {}).get("seconds") else None
    baseline = baseline or next((n for n, r in results.items() if r.get("seconds")), None)
    entry["ratio_to"] = baseline
    for result in results.values():
        if baseline and result.get("seconds"):
            ratios = round_ratios(
                result["seconds"]["values"], results[baseline]["seconds"]["values"]
            )
            result["ratio"] = _spread(ratios)


def _compile_core(
    core: Any, operands: tuple, segments: Any, reference: Any, result: dict[str, Any]
) -> Callable:
    """Compile one core's fwd+bwd, run it once, and its largest differences from the
    reference (output and each gradient)."""
    import jax
    import jax.numpy as jnp

    began = time.perf_counter()
    compiled = _fwd_bwd(core).lower(*operands, segments).compile()
    result["compile_s"] = round(time.perf_counter() - began, 2)
    result["fused_cudnn_kernel"] = "cudnn$fmha" in compiled.as_text()
    outputs = jax.block_until_ready(compiled(*operands, segments))
    if reference is not None:
        names = ("out", "dq", "dk", "dv")
        result["max_abs_diff"] = {
            n: float(jnp.max(jnp.abs(o.astype(jnp.float32) - r)))
            for n, o, r in zip(names, outputs, reference, strict=True)
        }
        result["reference_max_abs"] = {
            n: float(jnp.max(jnp.abs(r))) for n, r in zip(names, reference, strict=True)
        }
    return compiled


def _time_cores(
    compiled: dict[str, Callable],
    args: tuple,
    sizes: Sizes,
    budget: Budget,
    results: dict[str, dict],
) -> None:
    """Seconds per fwd+bwd call of each core, the cores round-robin (``repeats`` calls
    each per round), rounds while the section's time lasts (one at least)."""
    import jax

    seconds: dict[str, list[float]] = {name: [] for name in compiled}
    for round_index in range(sizes.rounds):
        if round_index and not budget.fits(5):
            break
        for name, function in compiled.items():
            began = time.perf_counter()
            for _ in range(sizes.repeats):
                outputs = function(*args)
            jax.block_until_ready(outputs)
            seconds[name].append((time.perf_counter() - began) / sizes.repeats)
    for name, values in seconds.items():
        if values:
            results[name]["seconds"] = _spread(values)


# -- gemm ----------------------------------------------------------------------------------


def gemm(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """bfloat16 and float8 products: TFLOP/s, fraction of the peak, FP8 against bf16."""
    from jaxmoe.plan.mfu import datasheet_peak_tflops

    peak = datasheet_peak_tflops(setup.device.device_kind, "bfloat16")
    found.update(
        peak_bf16_tflops=peak,
        peak_source=f"datasheet dense peak of {setup.device.device_kind}" if peak else None,
        timed="a chain of products x @ up @ down per call, bf16 and fp8 round-robin",
        rounds=setup.sizes.gemm_rounds,
        shapes=[],
    )
    for m, k, n in setup.sizes.gemms:
        entry = {"m": m, "k": k, "n": n}
        found["shapes"].append(entry)
        if not budget.fits(4):
            entry["error"] = "not run: the section's time ran out"
            continue
        try:
            _gemm_shape(setup, budget, m, k, n, peak, entry)
        except Exception as error:
            entry["error"] = _error_text(error)
    return found


def _gemm_chain(dtype: Any, pairs: int) -> Callable:
    """``x [m, k] -> (x @ up @ down) repeated``: ``pairs`` dependent pairs of products,
    float8 ones accumulated in float32 and cast back to float8."""
    import jax
    import jax.numpy as jnp

    dims = (((1,), (0,)), ((), ()))
    eight = jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)

    def product(a, b):
        if not eight:
            return a @ b
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(dtype)

    def chain(x, up, down):
        for _ in range(pairs):
            x = product(product(x, up), down)
        return x

    return jax.jit(chain)


def _gemm_operands(m: int, k: int, n: int) -> tuple[Any, Any, Any]:
    """``x [m, k]``, ``up [k, n]``, ``down [n, k]`` in float32, scaled to keep unit size."""
    import jax

    keys = jax.random.split(jax.random.key(1), 3)
    normal = jax.random.normal
    return (
        normal(keys[0], (m, k)),
        normal(keys[1], (k, n)) / math.sqrt(k),
        normal(keys[2], (n, k)) / math.sqrt(n),
    )


def _gemm_shape(
    setup: Setup, budget: Budget, m: int, k: int, n: int, peak: float | None, entry: dict
) -> None:
    import jax
    import jax.numpy as jnp

    sizes = setup.sizes
    pair_flops = 2 * (2 * m * k * n)
    pairs = max(1, min(32, round(sizes.gemm_call_flops / pair_flops)))
    flops = pairs * pair_flops
    repeats = max(1, math.ceil(sizes.gemm_measure_flops / flops))
    entry.update(products_per_call=2 * pairs, calls_per_measurement=repeats)
    wide = _gemm_operands(m, k, n)
    calls = {}
    for name, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        operands = tuple(x.astype(dtype) for x in wide)
        try:
            compiled = _gemm_chain(dtype, pairs).lower(*operands).compile()
            jax.block_until_ready(compiled(*operands))
            calls[name] = (compiled, operands)
        except Exception as error:
            entry[f"{name}_error"] = _error_text(error)
    for name, (compiled, _) in calls.items():
        entry[f"{name}_kernels"] = _gemm_kernels(compiled.as_text())
    if "fp8" in calls:
        entry["fp8_gemm"] = _holds_fp8_gemm(calls["fp8"][0].as_text())
        entry["fp8_max_rel_error"] = _fp8_error(*wide[:2])
    seconds = _time_calls(calls, sizes.gemm_rounds, repeats, budget)
    for name, values in seconds.items():
        entry[f"{name}_tflops"] = _spread([flops / s / 1e12 for s in values])
        if peak and name == "bf16":
            entry["bf16_of_peak"] = entry["bf16_tflops"]["median"] / peak
    if len(seconds) == 2:
        entry["fp8_over_bf16"] = _spread(round_ratios(seconds["bf16"], seconds["fp8"]))


def _time_calls(
    calls: dict[str, tuple], rounds: int, repeats: int, budget: Budget
) -> dict[str, list[float]]:
    """Seconds per call of each compiled function (``repeats`` calls queued, then waited
    for), the functions round-robin, rounds while the section's time lasts."""
    import jax

    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(rounds):
        if round_index and not budget.fits(3):
            break
        for name, (compiled, operands) in calls.items():
            began = time.perf_counter()
            for _ in range(repeats):
                result = compiled(*operands)
            jax.block_until_ready(result)
            seconds[name].append((time.perf_counter() - began) / repeats)
    return {name: values for name, values in seconds.items() if values}


def _gemm_kernels(hlo: str) -> list[str]:
    """The library calls and GEMM fusions of an optimized module."""
    kernels = set(re.findall(r'custom_call_target="([^"]+)"', hlo))
    kernels |= {kind for kind in ("__triton_gemm", "__cudnn$fusion") if kind in hlo}
    return sorted(kernels)


def _holds_fp8_gemm(hlo: str) -> bool:
    """Whether a GEMM of the module (cuBLAS, Triton or cuDNN) takes float8 operands."""
    gemm = re.compile(r"cublas|__triton_gemm|__cudnn\$fusion")
    return any("f8e4m3fn" in line and gemm.search(line) for line in hlo.splitlines())


def _fp8_error(x: Any, up: Any) -> float:
    """The float8 product's largest difference from the bfloat16 one, over the latter's
    largest magnitude (both accumulated in float32)."""
    import jax
    import jax.numpy as jnp

    dims = (((1,), (0,)), ((), ()))

    @jax.jit
    def error(x, up):
        def product(dtype):
            a, b = x.astype(dtype), up.astype(dtype)
            return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

        exact = product(jnp.bfloat16)
        return jnp.max(jnp.abs(product(jnp.float8_e4m3fn) - exact)) / jnp.max(jnp.abs(exact))

    return float(error(x, up))


# -- fp8 -----------------------------------------------------------------------------------

FP8_RECIPES = ("none", "tensorwise", "blockwise")


def fp8(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """One expert block forward and backward, its GEMMs in bfloat16 and in FP8."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmoe.layers.experts import Experts

    experts, tokens, d_model, hidden = setup.sizes.expert_block
    dtype = jnp.float32 if setup.dry else jnp.bfloat16
    flops = 3 * 2 * (3 * experts * tokens * d_model * hidden)  # 3 GEMMs, forward + 2 grads
    found.update(
        experts=experts, tokens=tokens, d_model=d_model, hidden=hidden, dtype=str(dtype.dtype),
        model_tflop=flops / 1e12, rounds=setup.sizes.rounds, recipes={},
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (experts, tokens, d_model), dtype)
    calls = {}
    for recipe in FP8_RECIPES:
        entry = found["recipes"][recipe] = {}
        block = Experts(
            experts, d_model, hidden, activation="swiglu", bias=False, fp8=recipe,
            dtype=dtype, rngs=nnx.Rngs(0),
        )  # fmt: skip
        graphdef, params = nnx.split(block)

        def loss(params, x, graphdef=graphdef):
            return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32) ** 2)

        try:
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()
            jax.block_until_ready(compiled(params, x))
        except Exception as error:
            entry["error"] = _error_text(error)
            continue
        entry["fp8_gemm"] = _holds_fp8_gemm(compiled.as_text())
        calls[recipe] = (compiled, (params, x))
    seconds = _time_calls(calls, setup.sizes.rounds, setup.sizes.repeats, budget)
    for recipe, values in seconds.items():
        entry = found["recipes"][recipe]
        entry["seconds"] = _spread(values)
        entry["tflops"] = _spread([flops / s / 1e12 for s in values])
        if recipe != "none" and "none" in seconds:
            entry["over_bf16"] = _spread(round_ratios(seconds["none"], values))
    return found


# -- step ----------------------------------------------------------------------------------


def step(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """One device's training step: time, tokens/s, MFU, and the cost model's estimate."""
    from jaxmoe.parallel.mesh import build_mesh

    sizes = setup.sizes
    mesh = build_mesh(_step_config(sizes, batch=1).parallel, [setup.device])
    batch, fit, captured = _fit_batch(mesh, sizes)
    config = _step_config(sizes, batch)
    model, moe = config.model, config.moe
    found.update(
        preset=sizes.step_preset,
        model=dict(
            d_model=model.d_model,
            layers=model.num_layers,
            d_ff=model.d_ff,
            heads=model.num_heads,
            kv_heads=model.kv_heads,
            seq_len=model.seq_len,
            vocab=model.vocab_size,
            dtype=model.dtype,
            attention=model.attention,
            attention_core=_core_kind(model),
            experts=moe.num_experts,
            top_k=moe.top_k,
            capacity_factor=moe.capacity_factor,
        ),
        layout="parallel data 1 x expert 1 (one device)",
        batch=batch,
        tokens_per_step=batch * model.seq_len,
        memory_fit=fit,
    )
    run, program, sharded = captured.get(batch) or _capture(config, mesh)
    try:
        found["estimate"] = _estimate(run, program, mesh)
    except Exception as error:  # the step is still measured
        found["estimate"] = {"error": _error_text(error)}
    if not budget.fits(20):
        found["measured"] = {"error": "not run: the section's time ran out"}
        return found
    found["measured"] = measured = {}
    _measure_step(setup, budget, run, sharded, measured)
    _compare(found, config, setup.device.device_kind)
    return found


def _core_kind(model: Any) -> str:
    """The attention core ``model.attention`` resolves to on this backend."""
    import jax.numpy as jnp

    from jaxmoe.layers.attention_core import resolve_core

    dtype, head_dim = jnp.dtype(model.dtype), model.attention_head_dim
    return resolve_core(model.attention, dtype=dtype, head_dim=head_dim).kind


def _step_config(sizes: Sizes, batch: int) -> Any:
    from jaxmoe.presets import preset

    config = preset(sizes.step_preset)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, **sizes.step_model),
        parallel=dataclasses.replace(config.parallel, data=1, expert=1),
        train=dataclasses.replace(config.train, batch_size=batch, microbatches=1),
        schedule=dataclasses.replace(config.schedule, name="none", profile=STEP_PROFILE),
    )


def _capture(config: Any, mesh: Any) -> tuple[Any, Any, Any]:
    """The resolved run, its captured per-device program and its sharded step."""
    from jaxmoe.train.resolved import resolve
    from jaxmoe.train.scheduled import capture_train_step

    run = resolve(config, mesh)
    program, sharded = capture_train_step(run)
    return run, program, sharded


def _fit_batch(mesh: Any, sizes: Sizes) -> tuple[int, dict[str, Any], dict]:
    """The largest candidate batch whose step the memory walk fits in the budget,
    extrapolated linearly from the walks of batches 1 and 2; how it was found; the
    captures of batches 1 and 2 (by batch)."""
    from jaxmoe.plan.memory import step_memory

    programs, totals = {}, {}
    method = "jaxmoe.plan.memory.step_memory at batches 1 and 2, extrapolated linearly"
    try:
        for rows in (1, 2):
            captured = _capture(_step_config(sizes, rows), mesh)
            programs[rows] = captured
            totals[rows] = step_memory(captured[1], captured[0].state_shapes).total
    except Exception as error:  # then the batch the walk gave on a CPU host
        fit = {"method": method, "error": _error_text(error), "fits": None}
        return sizes.step_batch_unwalked, fit, programs
    per_row = totals[2] - totals[1]
    fixed = totals[1] - per_row

    def estimate(rows: int) -> float:
        return fixed + rows * per_row

    fitting = [b for b in sizes.step_batches if estimate(b) <= sizes.step_memory_bytes]
    batch = max(fitting, default=min(sizes.step_batches))
    fit = {
        "method": method,
        "budget_bytes": sizes.step_memory_bytes,
        "walked_bytes": totals,
        "estimated_bytes": estimate(batch),
        "fits": bool(fitting),
    }
    return batch, fit, programs


def _estimate(run: Any, program: Any, mesh: Any) -> dict[str, Any]:
    """The cost model's seconds summed over the program's ops: whole, by phase, by block."""
    import scheduling

    cost = scheduling.cost_model(run.policy, mesh, program)
    total, phases, blocks = 0.0, {}, {}
    for op in program.ops:
        seconds = cost.seconds(op)
        total += seconds
        phases[op.phase.value] = phases.get(op.phase.value, 0.0) + seconds
        layer = re.match(r"layer_(\d+)(?:/|$)", op.layer)
        if layer:
            blocks[int(layer.group(1))] = blocks.get(int(layer.group(1)), 0.0) + seconds
    return {
        "profile": STEP_PROFILE,
        "ops": len(program.ops),
        "step_s": total,
        "phases_s": phases,
        "blocks_s": [blocks[i] for i in sorted(blocks)],
        "block_s": sum(blocks.values()) / max(1, len(blocks)),
    }


def _measure_step(
    setup: Setup, budget: Budget, run: Any, sharded: Any, measured: dict[str, Any]
) -> None:
    """Compile the step, warm it up, then time each step to completion."""
    import jax

    from jaxmoe.train.state import init_train_state

    sizes, config = setup.sizes, run.config
    state = init_train_state(run)
    batches = _token_batches(run, 3)
    began = time.perf_counter()
    compiled = sharded.jit().lower(state, batches[0]).compile()
    measured["compile_s"] = round(time.perf_counter() - began, 2)
    for index in range(sizes.warmup):
        state, metrics = compiled(state, batches[index % len(batches)])
    jax.block_until_ready(metrics)
    seconds, dropped = [], []
    for index in range(sizes.steps):
        if index >= 2 and not budget.fits(3):
            break
        began = time.perf_counter()
        state, metrics = compiled(state, batches[index % len(batches)])
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - began)
        dropped.append(float(metrics.get("dropped_fraction", 0.0)))
    measured["step_s"] = _spread(seconds)
    measured["dropped_fraction"] = sum(dropped) / len(dropped)
    measured["tokens_per_s"] = (
        config.train.batch_size * config.model.seq_len / Spread.of(seconds).median
    )


def _token_batches(run: Any, count: int) -> list[Any]:
    """Random token rows ``[batch, seq + 1]``, placed as the step reads its batches."""
    import jax
    from jax.sharding import NamedSharding

    from jaxmoe.parallel.mesh import token_spec

    config, mesh = run.config, run.on_mesh
    shape = (config.train.batch_size, config.model.seq_len + 1)
    sharding = NamedSharding(mesh, token_spec(mesh))
    keys = jax.random.split(jax.random.key(2), count)
    vocab = config.model.vocab_size
    return [
        jax.device_put(jax.random.randint(key, shape, 0, vocab, jax.numpy.int32), sharding)
        for key in keys
    ]


def _compare(found: dict[str, Any], config: Any, device_kind: str) -> None:
    """MFU, and the estimate over the measured time (the step, and one block)."""
    from jaxmoe.plan.mfu import datasheet_peak_tflops, mfu
    from jaxmoe.plan.model_flops import model_flops

    measured, estimate = found["measured"], found["estimate"]
    median = measured["step_s"]["median"]
    flops = model_flops(config)
    found["model_flops_per_step"] = flops.train_step()
    peak = datasheet_peak_tflops(device_kind, config.model.dtype)
    found["peak_tflops"] = peak
    if peak:
        found["mfu"] = mfu(flops.train_step(), median, 1, peak * 1e12)
        dropped = flops.train_step(measured["dropped_fraction"])
        found["mfu_dropped_not_counted"] = mfu(dropped, median, 1, peak * 1e12)
    if "error" in estimate:
        return
    block = median / config.model.num_layers
    found["comparison"] = {
        "step_estimate_over_measured": estimate["step_s"] / median,
        "block_measured_s": block,
        "block_measured_is": "derived: measured step time / layers (it includes the "
        "embedding, the head, the loss and the optimizer)",
        "block_estimate_over_measured": estimate["block_s"] / block,
    }


# -- schedule ------------------------------------------------------------------------------


def schedule(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """experiments.gpu_schedule_check on the mock topology, in a process of its own."""
    out = setup.out / "gpu_schedule_check.md"
    argv = [*SCHEDULE_ARGS, "--out", str(out)]
    found["command"] = command_line("experiments.gpu_schedule_check", argv)
    found["results_file"] = str(out)
    if setup.dry:
        found["skipped"] = (
            "gpu_schedule_check refuses CPU devices (XLA:CPU runs async collectives "
            "synchronously): not run in the dry run"
        )
        return found
    written = out.with_suffix(".json")
    written.unlink(missing_ok=True)  # an earlier run's figures are not this one's
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    command = [sys.executable, "-m", "experiments.gpu_schedule_check", *argv]
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=max(1.0, budget.left() - 5),
        )  # fmt: skip
        found["returncode"] = done.returncode
        found["output_tail"] = (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as expired:
        found["error"] = f"gpu_schedule_check ran past {expired.timeout:.0f} s and was stopped"
        found["output_tail"] = _text(expired.stdout)[-3000:] + _text(expired.stderr)[-3000:]
    if written.exists():
        found["results"] = json.loads(written.read_text())
    return found


def _text(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


SECTION_FUNCTIONS = {
    "attention": attention,
    "gemm": gemm,
    "fp8": fp8,
    "step": step,
    "schedule": schedule,
}


# -- the files -----------------------------------------------------------------------------


def _write(setup: Setup, results: dict[str, Any]) -> None:
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
        f"Command: `{results['command']}`",
        "",
        f"{results['devices']} x {results['device_kind']} ({results['platform']}), "
        f"jax {results['jax']}, XLA flags `{results['xla_flags']}`.",
        "",
    ]
    for name, found in results["sections"].items():
        lines += [f"## {name}", ""]
        if "error" in found:
            lines += [f"Error: `{found['error'].splitlines()[0]}`", ""]
        lines += REPORTERS[name](found)
        lines += [f"({found['seconds']:.1f} s of a {found['limit_s']:.0f} s limit.)", ""]
    return "\n".join(lines)


def _ms(found: dict[str, Any] | None) -> str:
    return _as_spread(found).format(scale=1e3, digits=3) if found else "-"


def _ratio(found: dict[str, Any] | None) -> str:
    return _as_spread(found).format(scale=1, digits=2) if found else "-"


def _report_attention(found: dict[str, Any]) -> list[str]:
    if "shape" not in found:
        return []
    shape = found["shape"]
    lines = [
        f"Batch {shape['batch']}, {shape['seq']} tokens, {shape['heads']} query heads over "
        f"{shape['kv_heads']} key/value heads of {shape['head_dim']}, {found['dtype']}, causal; "
        f"`auto` takes {found['auto']}. Forward + backward, median [range] over up to "
        f"{found['rounds']} round-robin rounds of {found['repeats']} calls; differences "
        "are the largest absolute ones from the dense core in float32.",
        "",
    ]
    for variant, entry in found["variants"].items():
        packed = f" ({entry['documents']} documents a row)" if "documents" in entry else ""
        lines += [
            f"**{variant}**{packed}",
            "",
            f"| core | compile s | fwd+bwd ms | / {entry.get('ratio_to') or '-'} | out | dq | "
            "dk | dv | cuDNN kernel |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, result in entry.get("cores", {}).items():
            if "error" in result and "compile_s" not in result:
                lines.append(f"| {name} | {result['error'].splitlines()[0][:120]} |||||||| ")
                continue
            diffs = result.get("max_abs_diff", {})
            cells = [f"{diffs[n]:.2e}" if n in diffs else "-" for n in ("out", "dq", "dk", "dv")]
            lines.append(
                f"| {name} | {result['compile_s']:.1f} | {_ms(result.get('seconds'))} | "
                f"{_ratio(result.get('ratio'))} | {' | '.join(cells)} | "
                f"{'yes' if result['fused_cudnn_kernel'] else 'no'} |"
            )
        lines += [f"- {name} not run: {why}" for name, why in entry.get("skipped", {}).items()]
        lines.append("")
    return lines


def _report_gemm(found: dict[str, Any]) -> list[str]:
    peak = found.get("peak_bf16_tflops")
    lines = [
        f"TFLOP/s, median [range] over {found.get('rounds')} rounds; the bf16 peak: "
        + (f"{peak:g} TFLOP/s ({found['peak_source']})." if peak else "unknown for this device.")
        + " Hopper's FP8 tensor-core peak is twice its bf16 peak.",
        "",
        "| m x k x n | bf16 TFLOP/s | of peak | fp8 TFLOP/s | fp8 / bf16 | FP8 GEMM | "
        "fp8 rel. error |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in found.get("shapes", []):
        shape = f"{entry['m']} x {entry['k']} x {entry['n']}"
        if "error" in entry:
            lines.append(f"| {shape} | {entry['error'].splitlines()[0][:120]} ||||||")
            continue
        of_peak = f"{entry['bf16_of_peak']:.0%}" if "bf16_of_peak" in entry else "-"
        fp8 = {True: "yes", False: "no", None: "-"}[entry.get("fp8_gemm")]
        error = entry.get("fp8_max_rel_error")
        lines.append(
            f"| {shape} | {_ratio(entry.get('bf16_tflops'))} | {of_peak} | "
            f"{_ratio(entry.get('fp8_tflops'))} | {_ratio(entry.get('fp8_over_bf16'))} | "
            f"{fp8} | {'-' if error is None else f'{error:.3f}'} |"
        )
    errors = [
        (e, k) for e in found.get("shapes", []) for k in ("bf16_error", "fp8_error") if k in e
    ]
    lines += [f"- {e['m']}x{e['k']}x{e['n']} {k}: `{e[k].splitlines()[0]}`" for e, k in errors]
    return [*lines, ""]


def _report_step(found: dict[str, Any]) -> list[str]:
    if "model" not in found:
        return []
    model = found["model"]
    lines = [
        f"Preset `{found['preset']}` at d_model {model['d_model']}, {model['layers']} layers, "
        f"d_ff {model['d_ff']}, {model['experts']} experts top-{model['top_k']}, "
        f"{model['seq_len']} tokens a row, {model['dtype']}, attention {model['attention']} "
        f"({model['attention_core']}); {found['layout']}; batch {found['batch']} "
        f"({found['tokens_per_step']:,} tokens), {_fit_text(found['memory_fit'])}.",
        "",
    ]
    estimate, measured = found.get("estimate", {}), found.get("measured", {})
    if "step_s" in estimate:
        lines.append(
            f"- cost model ({estimate['profile']}): step {estimate['step_s'] * 1e3:.2f} ms, "
            f"one block {estimate['block_s'] * 1e3:.3f} ms (mean over the blocks)"
        )
    else:
        lines.append(f"- cost model: {estimate.get('error', 'no estimate').splitlines()[0]}")
    if "step_s" not in measured:
        error = measured.get("error", "not measured")
        return [*lines, f"- measured: {error.splitlines()[0]}", ""]
    mfu = f"{found['mfu']:.1%}" if "mfu" in found else "- (no datasheet peak for this device)"
    lines.append(
        f"- measured: compile {measured['compile_s']:.1f} s; step {_ms(measured['step_s'])} ms; "
        f"{measured['tokens_per_s']:,.0f} tokens/s; MFU {mfu}; dropped fraction "
        f"{measured['dropped_fraction']:.3f}"
    )
    comparison = found.get("comparison")
    if comparison:
        lines.append(
            f"- estimate / measured: step {comparison['step_estimate_over_measured']:.2f}; "
            f"block {comparison['block_estimate_over_measured']:.2f}, the measured block "
            f"{comparison['block_measured_s'] * 1e3:.3f} ms ({comparison['block_measured_is']})"
        )
    return [*lines, ""]


def _fit_text(fit: dict[str, Any]) -> str:
    if "error" in fit:
        return f"the memory walk failed (`{fit['error'].splitlines()[0]}`): a set batch"
    return (
        f"the memory walk's estimate {fit['estimated_bytes'] / 1e9:.2f} GB of a "
        f"{fit['budget_bytes'] / 1e9:g} GB budget"
        + ("" if fit["fits"] else " (not even the smallest batch fits)")
    )


def _report_schedule(found: dict[str, Any]) -> list[str]:
    lines = [f"Command: `{found.get('command', '')}` (its own file: `{found.get('results_file')}`)"]
    if "skipped" in found:
        return [*lines, "", f"Skipped: {found['skipped']}.", ""]
    if found.get("returncode"):
        lines.append(f"\nIt exited with status {found['returncode']}.")
    lines += [
        "",
        "| schedule | windows kept | all-to-alls overlapped | compile s | step ms |",
        "|---|---|---|---|---|",
    ]
    for name, result in found.get("results", {}).items():
        if "error" in result:
            lines.append(f"| {name} | {result['error'].splitlines()[0][:120]} ||||")
            continue
        seconds = result.get("seconds")
        step_ms = Spread.of(seconds).format() if seconds else "-"
        lines.append(
            f"| {name} | {result['kept']} of {result['groups']} | {result['overlapped']} of "
            f"{result['all_to_alls']} | {result['compile_s']:.1f} | {step_ms} |"
        )
    return [*lines, ""]


def _report_fp8(found: dict[str, Any]) -> list[str]:
    if "recipes" not in found:
        return []
    lines = [
        f"{found['experts']} experts x {found['tokens']} tokens, d_model {found['d_model']}, "
        f"hidden {found['hidden']} (SwiGLU), {found['dtype']}; forward + backward "
        f"({found['model_tflop']:.2f} TFLOP a call), median [range] over up to "
        f"{found['rounds']} round-robin rounds. `over bf16`: bfloat16's time over this one's "
        "(above 1: faster).",
        "",
        "| model.fp8 | ms | TFLOP/s | over bf16 | FP8 GEMM |",
        "|---|---|---|---|---|",
    ]
    for recipe, entry in found["recipes"].items():
        if "error" in entry:
            lines.append(f"| {recipe} | {entry['error'].splitlines()[0][:120]} ||||")
            continue
        fp8 = {True: "yes", False: "no", None: "-"}[entry.get("fp8_gemm")]
        lines.append(
            f"| {recipe} | {_ms(entry.get('seconds'))} | {_ratio(entry.get('tflops'))} | "
            f"{_ratio(entry.get('over_bf16'))} | {fp8} |"
        )
    return [*lines, ""]


REPORTERS = {
    "attention": _report_attention,
    "gemm": _report_gemm,
    "fp8": _report_fp8,
    "step": _report_step,
    "schedule": _report_schedule,
}


if __name__ == "__main__":
    sys.exit(main())
