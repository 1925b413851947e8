"""A host program for ``test_peer_death``: two processes of two devices each wait in a
socket all-to-all, and process 1 kills itself (SIGKILL) while process 0 waits for its
pieces. Process 1 writes the moment of its death to ``OUT/killed`` first.

Run by ``EmulatedHosts.run``, which passes ``--coordinator``, ``--num-processes`` and
``--process-id``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    args = parser.parse_args()
    # Two devices in this process, whatever the parent's count.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from jax.sharding import NamedSharding, PartitionSpec

    from experiments.emulation.socket_transport import (
        SocketAllToAll,
        SocketTransport,
        all_to_all_now,
    )

    mesh = jax.make_mesh((4,), ("x",))
    spec = PartitionSpec("x")
    x = jax.make_array_from_callback(
        (4 * 64, 64), NamedSharding(mesh, spec), lambda index: jax.numpy.ones((64, 64))
    )
    op = SocketAllToAll(SocketTransport.connect(mesh, wait_s=300), "x")
    # Each process waits for pieces the other never sends (different keys): both block.
    key = 10 + jax.process_index()
    step = jax.jit(
        jax.shard_map(
            lambda b: all_to_all_now(op, b, key=key, split_axis=0, concat_axis=0),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )
    )
    compiled = step.lower(x).compile()
    if jax.process_index() == 1:

        def die() -> None:
            time.sleep(2.0)  # process 0 is waiting in the exchange by then
            (args.out / "killed").write_text(f"{time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
    jax.block_until_ready(compiled(x))


if __name__ == "__main__":
    main()
