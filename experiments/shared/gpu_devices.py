"""The GPUs an XLA:GPU check compiles for: the visible ones, a mocked cluster, or an
ahead-of-time topology.

- visible: ``jax.devices()``; the steps compile and run.
- ``mock=N``: JAX's mock GPU topology, N hosts of one GPU on this one; the steps compile
  and run, but only this process's device computes and collectives move no data.
- ``aot=N``: a topology of N GPUs in one node (``jax.experimental.topologies``). XLA's
  GPU plugin takes the GPUs' description from the attached GPU, or, given ``target``,
  from a target description file (:data:`TARGETS`), with no GPU attached: the plugin
  (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` of this JAX's version) compiles on any
  host, ``JAX_PLATFORMS=cpu`` keeping JAX itself off the missing driver. The steps
  compile to the module N GPUs would run, and do not run: the way to read the compiled
  order of a multi-GPU step without the GPUs.

Both options must be chosen before JAX starts its backends: :func:`configure` sets the
flags and the mock topology, :func:`devices` returns the devices to build the mesh over.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

TARGETS = Path(__file__).parent / "gpu_targets"
"""Target descriptions (``xla.GpuTargetConfigProto`` in text), one per GPU model."""


def configure(*, mock: int = 0) -> None:
    """Set XLA:GPU's scheduler flags (and the mock topology) before the backends start."""
    import scheduling.names
    from jaxmoe.parallel.host_devices import ensure_xla_flags

    ensure_xla_flags(list(scheduling.names.XLA_GPU_FLAGS))
    if mock:
        # Autotuning is otherwise shared out among the processes of a multi-host run, and
        # the mocked hosts never send their part (compilation waited for them).
        ensure_xla_flags(["--xla_gpu_shard_autotuning=false"])
        import jax

        jax.config.update("jax_mock_gpu_topology", f"1x{mock}x1")


def target_file(name: str) -> Path:
    """A target description by model name (``h100_sxm``) or by path."""
    path = Path(name)
    if path.suffix != ".txtpb":
        path = TARGETS / f"{name}.txtpb"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TARGETS.glob("*.txtpb")))
        raise SystemExit(f"--aot-target {name!r}: no such file; name one of {known} or a path")
    return path


def devices(*, aot: int = 0, target: Path | None = None) -> Sequence[Any]:
    """The devices to compile for: ``aot`` GPUs (of the attached kind, or as ``target``
    describes them), or the visible ones."""
    import jax

    if not aot:
        return jax.devices()
    from jax.experimental import topologies

    options = {"target_config": target.read_text()} if target else {}
    return topologies.get_topology_desc("jaxmoe", "cuda", topology=f"1x1x{aot}", **options).devices


def describe(
    found: Sequence[Any], *, mock: int = 0, aot: int = 0, target: Path | None = None
) -> str:
    """What the devices are, for a results file's header."""
    import jax

    if aot and target:
        return (
            f"{aot} x {found[0].device_kind} in one node, compiled ahead of time from the "
            f"target description `{target.name}` (no GPU attached; not run)"
        )
    kind = jax.devices()[0].device_kind
    if aot:
        return (
            f"{aot} x {kind} in one node, compiled ahead of time (a topology of the attached "
            "GPU's kind; not run)"
        )
    if mock:
        return (
            f"{mock} GPUs mocked on 1 x {kind} (JAX's mock GPU topology: one device "
            "computes, collectives move no data)"
        )
    return f"{len(found)} x {kind}"
