"""Calibrate an emulated link: does it behave like a wire of the configured rate?

A shaped link is an honest instrument for overlap only if communication costs what the
line rate says whatever way it is cut: a large message must reach (nearly) the rate, and
the same bytes in pieces, each sent after an idle gap, must take no less than the whole
(a shaper's token bucket refills in the gaps, and a large bucket lets pieces out at memory
speed: then chunking pays on the link alone, without any overlap). ``calibrate_link``
measures both, and a sweep of sizes, with ``experiments.emulation.link_probe`` between two
hosts of an ``EmulatedNetwork``; ``LinkCalibration.problems`` says which criterion fails.

Experiments measure on a shaped link inside ``calibrated_network``, which builds the
network, calibrates its link and refuses to go on when the calibration fails
(``LinkNotCalibrated``; ``allow_uncalibrated`` goes on under a loud warning); they record
``LinkCalibration.to_dict()`` in their results. ``calibrate_hosts`` only calibrates.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TextIO

from experiments.emulation.network import TBF_LATENCY_MS, EmulatedNetwork, LinkShape

MIN_RATE_FRACTION = 0.90
"""A large message must carry at least this fraction of the configured rate in payload
(TCP/IP and Ethernet headers take about 4.5% of the wire at a 1500-byte MTU)."""

MAX_PIECES_DEVIATION = 0.05
"""The same bytes in pieces must take within this fraction of the time of one message."""

PIECES = 8
MESSAGE_SECONDS = 0.1
"""The large message is this long at line rate (between 1 MiB and 64 MiB)."""

GAP_S = 0.03
"""Idle time before each message, not timed: longer than any bucket takes to refill."""

_PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LinkCalibration:
    """What one calibration measured, and against what criteria.

    Times are seconds per repeat; a series' time is the sum of its messages' times, each
    from the first byte sent to the receiver's acknowledgement of the last. The criteria use
    the fastest repeat of each: the link's capacity, which other work on the host's cores
    can only add to (and the repeat in which a bucket effect shows most).
    """

    rate_mbit: float
    bucket_bytes: int
    queue_latency_ms: float
    message_bytes: int
    pieces: int
    repeats: int
    gap_s: float
    message_s: list[float]
    pieces_s: list[float]
    sweep: list[dict[str, float]] = field(default_factory=list)
    min_rate_fraction: float = MIN_RATE_FRACTION
    max_pieces_deviation: float = MAX_PIECES_DEVIATION

    @property
    def line_rate_s(self) -> float:
        """Time of the large message at exactly the configured rate."""
        return self.message_bytes * 8 / (self.rate_mbit * 1e6)

    @property
    def rate_fraction(self) -> float:
        """Payload rate of the large message (fastest repeat) over the configured rate."""
        return self.line_rate_s / min(self.message_s)

    @property
    def pieces_ratio(self) -> float:
        """Time of the pieces over the time of the one message (fastest repeats)."""
        return min(self.pieces_s) / min(self.message_s)

    def problems(self) -> list[str]:
        """Each failed criterion, in a sentence; empty when the link is calibrated."""
        found = []
        if self.rate_fraction < self.min_rate_fraction:
            found.append(
                f"a {self.message_bytes / 2**20:.1f} MiB message reaches "
                f"{self.rate_fraction:.1%} of {self.rate_mbit:g} Mbit/s "
                f"(needs >= {self.min_rate_fraction:.0%}): the shaper or the host cannot keep "
                "up with this rate; choose a lower --link-mbit"
            )
        if abs(self.pieces_ratio - 1) > self.max_pieces_deviation:
            why = (
                "the shaper's bucket lets pieces out above line rate"
                if self.pieces_ratio < 1
                else "each message pays a fixed cost; other work on the cores can cause it"
            )
            found.append(
                f"the same bytes in {self.pieces} pieces take {self.pieces_ratio:.3f}x the time "
                f"of one message (needs within {self.max_pieces_deviation:.0%}): {why}"
            )
        return found

    @property
    def passed(self) -> bool:
        return not self.problems()

    def to_dict(self) -> dict:
        """JSON-ready: the measurements, the derived figures and the verdict."""
        return {
            **asdict(self),
            "line_rate_s": self.line_rate_s,
            "rate_fraction": self.rate_fraction,
            "pieces_ratio": self.pieces_ratio,
            "passed": self.passed,
            "problems": self.problems(),
        }

    def summary(self) -> str:
        """A few lines for the console: the criteria, the figures and the sweep."""
        verdict = "calibrated" if self.passed else "NOT CALIBRATED"
        lines = [
            f"link calibration ({verdict}): {self.rate_mbit:g} Mbit/s, tbf bucket "
            f"{self.bucket_bytes} B, queue {self.queue_latency_ms:g} ms; fastest of "
            f"{self.repeats} (sweep: median), {self.gap_s * 1e3:g} ms idle before each message",
            f"  one {self.message_bytes / 2**20:.2f} MiB message: {min(self.message_s) * 1e3:.1f} "
            f"ms (line rate {self.line_rate_s * 1e3:.1f} ms): {self.rate_fraction:.1%} of the rate",
            f"  the same bytes in {self.pieces} pieces: {min(self.pieces_s) * 1e3:.1f} ms, "
            f"{self.pieces_ratio:.3f}x one message",
        ]
        for point in self.sweep:
            rate = point["bytes"] * 8 / point["seconds"] / 1e6
            lines.append(
                f"  {point['bytes']:>10,d} B: {point['seconds'] * 1e3:8.2f} ms, {rate:7.1f} Mbit/s"
            )
        lines += [f"  FAILS: {problem}" for problem in self.problems()]
        return "\n".join(lines)


def message_bytes_for(rate_mbit: float) -> int:
    """The large message: ``MESSAGE_SECONDS`` of line rate, a multiple of 8 pieces of 4 KiB."""
    size = rate_mbit * 1e6 / 8 * MESSAGE_SECONDS
    size = min(max(size, 2**20), 64 * 2**20)
    unit = PIECES * 4096
    return round(size / unit) * unit


def sweep_sizes(message_bytes: int) -> list[int]:
    """Sizes from 16 KiB up to the large message, by factors of 4."""
    sizes, size = [], 16 * 1024
    while size < message_bytes:
        sizes.append(size)
        size *= 4
    return [*sizes, message_bytes]


def calibrate_link(
    network: EmulatedNetwork,
    *,
    message_bytes: int | None = None,
    repeats: int = 5,
    source: int = 0,
    sink: int = 1,
) -> LinkCalibration:
    """Measure the shaped link from host ``source`` to host ``sink`` of ``network``.

    Raises:
        ValueError: the network's link is unshaped or has fewer than two hosts.
        RuntimeError: the probe failed (with its error output).
    """
    rate_mbit = network.link.rate_mbit
    if rate_mbit is None or network.link.bucket_bytes is None:
        raise ValueError("calibrate_link needs a shaped link (LinkShape.rate_mbit is None)")
    if network.hosts < 2:
        raise ValueError(f"calibrate_link needs two hosts, the network has {network.hosts}")
    message_bytes = message_bytes_for(rate_mbit) if message_bytes is None else message_bytes
    if message_bytes % PIECES:
        raise ValueError(f"message_bytes must be a multiple of {PIECES}, got {message_bytes}")
    sizes = sweep_sizes(message_bytes)
    plan = {
        "gap_s": GAP_S,
        "repeats": repeats,
        "series": {
            "message": [message_bytes],
            "pieces": [message_bytes // PIECES] * PIECES,
            **{f"sweep-{size}": [size] for size in sizes[:-1]},
        },
    }
    totals = _run_probe(network, plan, source, sink)
    sweep = [
        {"bytes": size, "seconds": statistics.median(totals[f"sweep-{size}"])}
        for size in sizes[:-1]
    ]
    sweep.append({"bytes": message_bytes, "seconds": statistics.median(totals["message"])})
    return LinkCalibration(
        rate_mbit=rate_mbit,
        bucket_bytes=network.link.bucket_bytes,
        queue_latency_ms=TBF_LATENCY_MS,
        message_bytes=message_bytes,
        pieces=PIECES,
        repeats=repeats,
        gap_s=GAP_S,
        message_s=totals["message"],
        pieces_s=totals["pieces"],
        sweep=sweep,
    )


def _run_probe(
    network: EmulatedNetwork, plan: dict, source: int, sink: int
) -> dict[str, list[float]]:
    probe = [sys.executable, "-m", "experiments.emulation.link_probe"]
    address = network.host_addresses[sink]
    server = subprocess.Popen(
        network.command(sink, [*probe, "serve", address]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"link probe server failed: {server.communicate()[1][-2000:]}")
        measured = subprocess.run(
            network.command(source, [*probe, "measure", address, port, "--plan", json.dumps(plan)]),
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
        )
        if measured.returncode != 0:
            raise RuntimeError(f"link probe failed: {measured.stderr[-2000:]}")
        server.wait(timeout=_PROBE_TIMEOUT_S)
        return json.loads(measured.stdout)
    finally:
        if server.poll() is None:
            server.kill()
        server.communicate()


def ensure_calibrated(
    calibration: LinkCalibration, *, allow_uncalibrated: bool, stream: TextIO | None = None
) -> bool:
    """Print the calibration; True when experiments may run on this link.

    An uncalibrated link is refused, or with ``allow_uncalibrated`` accepted under a loud
    warning (its results then record ``passed: false``). Prints to ``stream`` (standard error).
    """
    stream = sys.stderr if stream is None else stream
    print(calibration.summary(), file=stream)
    if calibration.passed:
        return True
    rule = "!" * 78
    if allow_uncalibrated:
        print(
            f"{rule}\nWARNING: the link is NOT calibrated; figures measured on it may show the "
            f"shaper, not overlap (--allow-uncalibrated).\n{rule}",
            file=stream,
        )
        return True
    print(
        "refusing to run experiments on an uncalibrated link "
        "(--allow-uncalibrated runs them anyway, recorded as such)",
        file=stream,
    )
    return False


class LinkNotCalibrated(RuntimeError):
    """The shaped link failed its calibration, and running on it was not allowed."""

    def __init__(self, calibration: LinkCalibration):
        super().__init__("; ".join(calibration.problems()))
        self.calibration = calibration


@contextlib.contextmanager
def calibrated_network(
    hosts: int, link: LinkShape, *, allow_uncalibrated: bool = False
) -> Iterator[tuple[EmulatedNetwork, LinkCalibration]]:
    """An ``EmulatedNetwork`` of ``hosts`` hosts on the shaped ``link``, calibrated first
    (hosts 0 and 1; the calibration is printed to standard error).

    Raises:
        LinkNotCalibrated: the link failed and ``allow_uncalibrated`` is false.
    """
    with EmulatedNetwork(hosts, link) as network:
        calibration = calibrate_link(network)
        if not ensure_calibrated(calibration, allow_uncalibrated=allow_uncalibrated):
            raise LinkNotCalibrated(calibration)
        yield network, calibration


def calibrate_hosts(hosts: int, link: LinkShape) -> LinkCalibration:
    """Only calibrate ``link``, on a network of ``hosts`` hosts (at least two)."""
    with EmulatedNetwork(max(hosts, 2), link) as network:
        return calibrate_link(network)
