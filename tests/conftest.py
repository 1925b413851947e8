"""Test set-up, before jax is first imported: 8 fake CPU devices, and XLA:CPU's code
generation made cheap.

Most of the suite's time is XLA compiling small training steps that then run for a few
steps. Two flags cut it: ``--xla_backend_optimization_level=0`` (LLVM's optimisation
off: about 60% of the CPU time) and ``--xla_cpu_use_fusion_emitters=false`` (fusions
emitted by XLA:CPU's older IR emitters, not its MLIR fusion emitters: about 40% less
backend compile time again on a family's scheduled step). The tests check what is
computed, never how fast. The second flag changes which ops XLA:CPU fuses (the `tiny`
preset's step: 739 fusions instead of 880, temporary memory 0.06% less), well inside
what the memory tests allow; the experiments, which measure, run without either flag.
Processes the tests start inherit the flags.

Each test module's compiled programs are released when it ends: XLA:CPU maps every
executable's code into memory, and a worker that kept all of them would reach the
kernel's limit on memory mappings (``vm.max_map_count``, 65530 by default) and crash
inside the compiler."""

import gc
import os

import pytest

_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FLAGS]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
