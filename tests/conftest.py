"""Test set-up, before jax is first imported: 8 fake CPU devices, and XLA:CPU's backend
(LLVM) optimisation off.

Most of the suite's time is XLA compiling small training steps that then run for a few
steps: at ``--xla_backend_optimization_level=0`` they compile in about 60% of the CPU
time, and without the verification of the MLIR each fusion emitter writes
(``--xla_cpu_emitter_verification_level=0``) in a few percent less again. The tests check
what is computed, never how fast: neither flag changes what the generated code computes,
the HLO passes (fusion, buffer assignment, the memory analysis the memory tests read) are
the same at every level, and processes the tests start inherit the flags.
(Compiling mixtral-tiny's step on 8 devices, XLA's HLO passes take about a fifth of the
CPU time, Shardy's propagation the largest of them; the rest is lowering and code
generation. ``--xla_cpu_parallel_codegen_split_count=1``,
``--xla_llvm_disable_expensive_passes`` and XNNPACK off change a test's CPU time by less
than its noise; this XLA has no other emitters to choose.)

Each test module's compiled programs are released when it ends: XLA:CPU maps every
executable's code into memory, and a worker that kept all of them would reach the
kernel's limit on memory mappings (``vm.max_map_count``, 65530 by default) and crash
inside the compiler. What one module, worker or started process compiled, the others
read back from JAX's persistent compilation cache, a directory of this run's own: the
same executable, so nothing a test compares changes."""

import gc
import os
import resource
import shutil
import tempfile
import time

import pytest

from jaxmoe.plan.collector import THRESHOLDS  # imports no JAX

_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_emitter_verification_level=0",
)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Made by the first process of the run (pytest itself, before xdist starts its workers),
# inherited by the workers and the processes tests start; removed by the one that made it.
_CACHE_OWNER = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _CACHE_OWNER:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxmoe-tests-xla-")
    # Every program, however quick to compile: small steps compile in well under JAX's
    # default threshold of one second, and the small programs of the layer tests, and the
    # operations run outside a jit, which every module compiles again once the previous
    # module's caches are released, read back in less time than they compile.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# Files the tests of the run share (the text of the small runs: tests/train/runs.py), in a
# directory made and removed as the cache is.
_FILES_OWNER = "JAXMOE_TEST_FILES" not in os.environ
if _FILES_OWNER:
    os.environ["JAXMOE_TEST_FILES"] = tempfile.mkdtemp(prefix="jaxmoe-tests-files-")


# The run's wall time is counted from here: the conftest is imported before collection.
_STARTED = time.monotonic()

# Tracing and lowering a step allocate millions of short-lived objects: at Python's
# default thresholds (700, 10, 10) the collector runs a full collection of the whole heap
# (JAX, Flax, the test modules) every 70,000 net allocations, about 6% of a test's CPU
# time. Young objects are still collected every 50,000; the whole heap after each module
# (below). What a test computes does not depend on when garbage is collected.
gc.set_threshold(*THRESHOLDS)


def pytest_addoption(parser):
    parser.addoption(
        "--slow", action="store_true", help="also run the cases marked slow (make test-all)"
    )


def pytest_collection_modifyitems(config, items):
    """Leave out the cases marked ``slow`` (another layout, family, schedule, option set or
    size for a claim a default case checks) unless ``--slow`` is given, a ``-m`` expression
    chooses, or a test is named by its id."""
    named = any("::" in arg for arg in config.args)
    if config.getoption("--slow") or config.getoption("-m") or named:
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


def pytest_collection_finish(session):
    """The modules imported by collection live to the end: out of the collector's way."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    if _CACHE_OWNER:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    if _FILES_OWNER:
        shutil.rmtree(os.environ["JAXMOE_TEST_FILES"], ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """One line after the slowest tests (``--durations``): the run's CPU time, user + sys of
    this process and of its children (the xdist workers and the processes the tests start,
    which the workers wait for), and its wall time. In the controlling process only: the
    workers have ended and been waited for by now, so their time is counted."""
    if hasattr(config, "workerinput"):
        return
    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    user, system = own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime
    wall = time.monotonic() - _STARTED
    terminalreporter.write_line(
        f"CPU time {(user + system) / 60:.1f} min: user {user:.0f} s + sys {system:.0f} s "
        f"(workers and the processes tests started included); wall {wall / 60:.1f} min"
    )


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (``make test``): one worker per core, at most 4, to bound the memory:
    each worker compiles for 8 fake devices and some tests start processes of their own."""
    return max(1, min(os.cpu_count() or 1, 4))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After a module: clear its cached helpers (which may hold compiled steps) and JAX's
    caches, so that its executables are freed."""
    yield
    for value in vars(request.module).values():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()
    import jax

    jax.clear_caches()
    gc.collect()
