"""The emulated-cluster regime of the overlap evaluations, and how a run of it is summarised.

``experiments.lancet_eval`` (a), ``experiments.simulator_validation`` and
``experiments.comet_cluster`` (through the validation) measure the same
regime: ``tiny`` with top-2 routing and 128 sequences per step, on 2 hosts x 1 device
(expert parallel over the link) joined by a calibrated 50 Mbit/s link. There the
all-to-alls are most of the step (on the unshaped link the step takes a fraction of its
time on the shaped one), so overlap has something to hide. Every all-to-all runs over the
socket transport (``experiments.emulation.socket_transport``, a research option:
``experiments.emulation.experimental``), ``none`` too (synchronously), so that speedups
over ``none`` are overlap, not a change of transport. The gradient reductions are XLA's
(gloo) in every schedule.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.emulation.schedule_runs import ScheduleRequest

PRESET = "tiny"
HOSTS, DEVICES_PER_HOST, LINK_MBIT = 2, 1, 50.0
SCHEDULES = ("none", "async", "partition", "lancet")


def train_flags(link_mbit: float = LINK_MBIT) -> list[str]:
    """Layout, routing, batch, the scheduling (the analytic CPU profile told the link's
    rate, small reductions left synchronous), and the transport of the all-to-alls (the
    last two research options: ``experiments.emulation.experimental``)."""
    return [
        "--parallel.data", "1", "--parallel.expert", "2", "--moe.top_k", "2",
        "--train.batch_size", "128", "--schedule.profile", "cpu",
        "--schedule.async_min_bytes", "262144",
        "--experimental.link_mbit", f"{link_mbit:g}",
        "--experimental.transport", "socket",
    ]  # fmt: skip


def label(link_mbit: float = LINK_MBIT) -> str:
    return (
        f"{PRESET}, top-2, 128 sequences, {HOSTS} hosts x {DEVICES_PER_HOST} device, "
        f"{link_mbit:g} Mbit/s, socket all-to-alls"
    )


def request(
    *,
    link_mbit: float = LINK_MBIT,
    quick: bool = False,
    shaped_only: bool = False,
    schedules: tuple[str, ...] = SCHEDULES,
    sweep: Path | None = None,
    extra_flags: tuple[str, ...] = (),
    traces: Path | None = None,
) -> ScheduleRequest:
    """The measurement of the regime (``schedule_runs.measure_schedules``); ``sweep``: also
    write the link's collective curves there. ``quick``: 3 rounds and ``shaped_only``;
    ``shaped_only``: no runs on the unshaped link (no compute-only figures); ``schedules``:
    cluster entries (``NAME`` or ``NAME:N``), the first the baseline of the speedups;
    ``extra_flags``: more ``jaxmoe train`` flags (``--train.microbatches 4``); ``traces``:
    trace every schedule's step there."""
    repeats, warmup = (3, 1) if quick else (6, 2)
    return ScheduleRequest(
        schedules=tuple(schedules),
        preset=PRESET,
        overrides=(*train_flags(link_mbit), *extra_flags),
        hosts=HOSTS,
        devices_per_host=DEVICES_PER_HOST,
        link_mbit=link_mbit,
        repeats=repeats,
        warmup=warmup,
        shaped_only=quick or shaped_only,
        sweep=sweep,
        traces=traces,
    )


def summary(report: dict) -> str:
    """The run's calibration, control verdict and breakdown of ``none``, in one paragraph."""
    calibration = report["link_calibration"]
    control = report["overlap_control"]
    none = next(row for row in report["schedules"] if row["schedule"] == "none")
    ratio = statistics.median(control["chained_over_independent"])
    text = (
        f"Link {'calibrated' if calibration['passed'] else 'NOT CALIBRATED'}: a "
        f"{calibration['message_bytes'] / 2**20:.2f} MiB message at "
        f"{calibration['rate_fraction']:.1%} of {calibration['rate_mbit']:g} Mbit/s, "
        f"{calibration['pieces']} pieces {calibration['pieces_ratio']:.3f}x one message. "
        f"Control in the same run: independent {_median_ms(control['independent'])}, chained "
        f"{_median_ms(control['chained'])}, unchunked {_median_ms(control['unchunked'])} ms; "
        f"chained / independent {ratio:.3f} at the median "
        f"({'overlap shown' if control['overlap_shown'] else 'NO overlap shown'}). "
        f"`none`: step {none['step_s'] * 1e3:.1f} ms"
    )
    compute = none["compute_only_s"]
    if compute == compute:  # measured (not a --shaped-only run)
        text += (
            f", the same step on the unshaped link {compute * 1e3:.1f} ms, so communication "
            f"is {1 - compute / none['step_s']:.0%} of it"
        )
    return (
        text + f"; XLA's collectives of the step replayed alone on the shaped link "
        f"{report['communication_only_s'] * 1e3:.1f} ms. Machine: {report['machine']}."
    )


def _median_ms(milliseconds: list[float]) -> str:
    return f"{statistics.median(milliseconds):.1f}"
