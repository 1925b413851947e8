"""Time messages over one TCP connection between two emulated hosts: the link's own figures.

    python -m experiments.emulation.link_probe serve ADDRESS  # prints its port, then serves
    python -m experiments.emulation.link_probe measure ADDRESS PORT --plan PLAN.json

The measuring side sends each message of the plan as a length header and the bytes; the
serving side answers one byte once it has them all, so a message's time runs from its first
byte sent to the whole of it received. Between messages the sender stays idle for
``gap_s`` (not timed), long enough for any token bucket on the path to refill: pieces are
timed as a collective after a burst of computation would see them, the case in which a
shaper's bucket lets small messages out faster than the line rate.

A plan is ``{"gap_s": G, "series": {NAME: [BYTES, ...], ...}, "repeats": R}``: each series
is sent R times over (repeats interleaved), and the result is, per series, the R totals of
its message times in seconds, printed as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 20
_TIMEOUT_S = 60.0


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    parts, remaining = [], size
    while remaining:
        part = connection.recv(min(remaining, _CHUNK))
        if not part:
            raise ConnectionError(f"peer closed with {remaining} of {size} bytes unread")
        parts.append(part)
        remaining -= len(part)
    return b"".join(parts)


def _drain(connection: socket.socket, size: int) -> None:
    buffer = bytearray(min(size, _CHUNK) or 1)
    view, remaining = memoryview(buffer), size
    while remaining:
        received = connection.recv_into(view[: min(remaining, len(buffer))])
        if not received:
            raise ConnectionError(f"peer closed with {remaining} of {size} bytes unread")
        remaining -= received


def serve(address: str) -> None:
    """Answer each length-prefixed message with one byte, until the peer closes."""
    with socket.create_server((address, 0)) as server:
        server.settimeout(_TIMEOUT_S)
        print(server.getsockname()[1], flush=True)
        connection, _ = server.accept()
        with connection:
            connection.settimeout(_TIMEOUT_S)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while header := connection.recv(_HEADER.size, socket.MSG_WAITALL):
                (size,) = _HEADER.unpack(header)
                _drain(connection, size)
                connection.sendall(b"\x01")


def measure(address: str, port: int, plan: dict) -> dict[str, list[float]]:
    """Seconds per repeat for each series of the plan (see the module docstring)."""
    gap_s, repeats = float(plan["gap_s"]), int(plan["repeats"])
    series: dict[str, list[int]] = plan["series"]
    payload = bytes(max(max(sizes) for sizes in series.values()))
    totals: dict[str, list[float]] = {name: [] for name in series}
    with socket.create_connection((address, port), timeout=_TIMEOUT_S) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(payload)
        for _ in range(repeats):
            for name, sizes in series.items():
                total = 0.0
                for size in sizes:
                    time.sleep(gap_s)
                    started = time.perf_counter()
                    connection.sendall(_HEADER.pack(size))
                    connection.sendall(view[:size])
                    _receive_exactly(connection, 1)
                    total += time.perf_counter() - started
                totals[name].append(total)
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("serve", "measure"))
    parser.add_argument("address")
    parser.add_argument("port", type=int, nargs="?")
    parser.add_argument("--plan", help="the plan as JSON (measure)")
    args = parser.parse_args(argv)
    if args.role == "serve":
        serve(args.address)
        return 0
    if args.port is None or args.plan is None:
        parser.error("measure needs PORT and --plan")
    print(json.dumps(measure(args.address, args.port, json.loads(args.plan))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
