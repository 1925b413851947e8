"""Does XLA:GPU keep the planned windows, and how are they best pinned? A toy.

    python -m experiments.gpu_groups_probe [--mock-devices 8 | --aot-devices 8 \\
        [--aot-target h100_sxm]] [--timeout 120]

A per-device step of two all-to-alls with matrix products beside them (one window with
two independent products, one with a chain of two) is scheduled with the ``async``
policy, its collectives emitted as XLA's async pairs or synchronously at their planned
starts (the ``sync`` transport: XLA splits them itself), its windows pinned by
optimization barriers, by scheduling groups or not at all
(:func:`scheduling.runtime.pinning.pin_windows`; where the adapter knows XLA to mishandle
groups they are withheld, and the step says why); last, without the scheduler, one
group written by hand around an all-to-all and a product (``set_xla_metadata``, as a
model would). Each is compiled for the GPU under
:data:`scheduling.names.XLA_GPU_FLAGS`. For each it prints whether XLA compiled it, the
pinned windows of the optimized module with their positions
(:func:`scheduling.hlo_windows`), every async pair with the compute between its start
and done (:func:`scheduling.async_pairs`), and the entry computation's collectives and
products. Seconds on a GPU where the train step's check
(:mod:`experiments.gpu_schedule_check`) takes minutes: the first thing to run on a lent
GPU. A compile that outlasts ``--timeout`` prints where it waits and exits. The devices
are the visible GPUs, a mocked cluster or an ahead-of-time topology
(:mod:`experiments.shared.gpu_devices`).
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import sys
import time


def _step(x, w):
    import jax

    a = jax.lax.all_to_all(x * 2.0, "x", 0, 0, tiled=True)
    independent = x @ w, (x * 3.0) @ w
    b = jax.lax.all_to_all(independent[1], "x", 0, 0, tiled=True)
    chained = ((x * 5.0) @ w) @ w
    return a @ w + independent[0] + b @ w + chained


def _grouped_by_hand(x, w):
    import jax
    from jax.experimental.xla_metadata import set_xla_metadata

    with set_xla_metadata(_scheduling_group_id=0):
        a = jax.lax.all_to_all(x, "x", 0, 0, tiled=True)
        independent = x @ w
    return a @ w + independent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mock-devices", type=int, default=0, help="JAX's mock GPU topology")
    parser.add_argument(
        "--aot-devices", type=int, default=0, help="compile for N GPUs of this kind, not run"
    )
    parser.add_argument(
        "--aot-target", default=None, help="with --aot-devices: a GPU model's description"
    )
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--timeout", type=int, default=120)
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)

    from experiments.shared import gpu_devices

    gpu_devices.configure(mock=args.mock_devices)
    target = args.aot_target and gpu_devices.target_file(args.aot_target)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import scheduling

    found = gpu_devices.devices(aot=args.aot_devices, target=target)
    described = gpu_devices.describe(
        found, mock=args.mock_devices, aot=args.aot_devices, target=target
    )
    print(f"{described}; {jax.local_device_count()} local, jax {jax.__version__}")
    devices = len(found)
    mesh = Mesh(np.asarray(found, dtype=object), ("x",))
    rows = args.rows

    def sds(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    example = (sds((devices * rows, rows), P("x")), sds((rows, rows), P()))
    specs = dict(mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))

    def scheduled(transport: str, pin: str):
        # Scheduling groups are a research option, not a policy's pin.
        groups = pin == "groups"
        policy = scheduling.SchedulePolicy(
            name="async", xla_pin="barriers" if groups else pin, transport=transport
        )
        experimental = scheduling.ExperimentalOptions(xla_groups=groups)
        step, _ = scheduling.optimize(
            _step, *example, **specs, policy=policy, experimental=experimental
        )
        if step.pinned.withheld:
            print(f"  groups withheld: {step.pinned.withheld}")
        return step.lower(*example)

    def metadata():  # one group by hand, as a model would write it: no scheduler involved
        return jax.jit(jax.shard_map(_grouped_by_hand, **specs, check_vma=False)).lower(*example)

    cases = {
        f"{transport}, {pin}": functools.partial(scheduled, transport, pin)
        for transport in ("xla", "sync")
        for pin in ("barriers", "groups", "none")
    } | {
        # Last: where XLA crashes on it, the process ends here.
        "set_xla_metadata group": metadata,
    }
    for label, lower in cases.items():
        print(f"{label}: compiling", flush=True)
        began = time.perf_counter()
        try:
            lowered = lower()
            text = lowered.compile().as_text()
        except Exception as error:
            print(f"{label}: not compiled: {str(error)[:600]}", flush=True)
            continue
        print(f"{label}: compiled in {time.perf_counter() - began:.1f} s")
        # What the compiler was handed: the ops that carry a window in the lowered module.
        emitted = [line for line in lowered.as_text().splitlines() if "mhlo.frontend" in line]
        barriers = lowered.as_text().count("optimization_barrier")
        print(f"  lowered: {len(emitted)} ops carry a window, {barriers} barriers")
        for line in emitted:
            print("    ", line.strip()[:300])
        for group, window in scheduling.hlo_windows(text).items():
            print(f"  window {group}: start {window.start}, done {window.done}, members "
                  f"{window.inside}, kept {window.kept}")  # fmt: skip
        for pair in scheduling.async_pairs(text):
            print(f"  {pair.kind} {pair.name}: {pair.between} computations between")
        entry = text.split("\nENTRY", 1)[-1].splitlines()
        for line in entry:
            if any(word in line for word in ("-start", "-done", "all-to-all", "gemm", "dot")):
                print("   ", line.strip()[:240])
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
