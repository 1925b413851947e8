"""Several schedules' real training steps on the emulated cluster, measured side by side.

``measure_schedules`` is one whole measurement, ``experiments.cluster``'s (and, through
the regime of ``overlap_regime``, the overlap evaluations'):

1. the shaped link, calibrated (``link_calibration.calibrated_network``: refused when it
   fails, unless allowed);
2. the overlap control on the same hosts and link (``overlap_control``), unless left out;
3. every schedule's step in interleaved rounds (``step_rounds``), and the step's
   collectives alone (``collectives_only``), on the shaped link;
4. optionally, the link's collective curves (``link_curves``: ``jaxmoe link-curves``),
   with the calibration added to their file;
5. unless ``shaped_only``: steps and collectives again on the unshaped link (veth at
   memory speed: communication made nearly free), the compute-only figures.

With ``traces``, every schedule's step is also traced after its rounds, on each link
(``step_rounds --trace``).

It returns a ``ScheduleMeasurement``; ``to_json`` is the results file's layout (what
``experiments.cluster --json`` writes and the evaluations read back), ``format_table``
its table.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.emulation.collectives_only import run_collectives_only
from experiments.emulation.experimental import Experimental
from experiments.emulation.hosts import EmulatedHosts, check_hosts_fill_layout, machine
from experiments.emulation.link_calibration import LinkCalibration, calibrated_network
from experiments.emulation.link_curves import run_link_curves
from experiments.emulation.network import EmulatedNetwork, LinkShape
from experiments.emulation.overlap_control import ControlResult, ControlSettings, run_control
from experiments.emulation.step_rounds import run_step_rounds, with_schedule
from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread, round_ratios
from jaxmoe.config import Config, ConfigError
from scheduling.names import POLICIES


@dataclass(frozen=True)
class ScheduleRequest:
    """What to measure: the schedules (``NAME`` or ``NAME:N``, the first the baseline of
    the speedups), the training configuration as ``jaxmoe train`` flags (and research
    options among them: ``experiments.emulation.experimental``), the hosts and their link,
    the rounds, and which parts to run."""

    schedules: tuple[str, ...] = ("none",)
    preset: str = "tiny"
    overrides: tuple[str, ...] = ()
    hosts: int = 2
    devices_per_host: int = 4
    link_mbit: float = 300.0
    delay_ms: float = 0.0
    repeats: int = 10
    warmup: int = 2
    shaped_only: bool = False
    control: bool = True
    allow_uncalibrated: bool = False
    sweep: Path | None = None  # write the link's collective curves here
    traces: Path | None = None  # trace each schedule's steps here (step_rounds --trace)

    def check(self) -> Config:
        """The training configuration, every setting checked before anything starts.

        Raises:
            ConfigError: a schedule, flag or value is wrong, or the layout does not fill
                the hosts.
        """
        if not self.schedules:
            raise ConfigError("--schedules: name at least one schedule")
        unknown = [s for s in self.schedules if s.split(":")[0] not in POLICIES]
        if unknown:
            raise ConfigError(f"--schedules: {unknown} not among {', '.join(POLICIES)}")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError("--repeats must be at least 1 and --warmup at least 0")
        try:
            LinkShape(rate_mbit=self.link_mbit, delay_ms=self.delay_ms)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        config = self.config()
        self.experimental.configure(config)  # the research options, checked
        check_hosts_fill_layout(config, self.hosts, self.devices_per_host)
        for schedule in self.schedules:  # each schedule's policy, before any host starts
            try:
                with_schedule(config, schedule)
            except ValueError as error:
                raise ConfigError(f"--schedules {schedule}: {error}") from None
        return config

    def config(self) -> Config:
        """The training configuration (without the research options)."""
        from jaxmoe.cli.parser import config_from_train_args

        train_argv, _ = Experimental.split(self.overrides)
        return config_from_train_args(["--preset", self.preset, *train_argv])

    @property
    def experimental(self) -> Experimental:
        """The research options among the overrides."""
        return Experimental.split(self.overrides)[1]

    @property
    def shaped_link(self) -> LinkShape:
        return LinkShape(rate_mbit=self.link_mbit, delay_ms=self.delay_ms)

    def cluster_argv(self, json_path: Path | str | None = None) -> list[str]:
        """The ``experiments.cluster`` arguments that make this measurement (with
        ``--json json_path``)."""
        argv = [
            *("--hosts", str(self.hosts), "--devices-per-host", str(self.devices_per_host)),
            *("--link-mbit", f"{self.link_mbit:g}"),
            *(("--delay-ms", f"{self.delay_ms:g}") if self.delay_ms else ()),
            *("--preset", self.preset, "--repeats", str(self.repeats)),
            *("--warmup", str(self.warmup), "--schedules", ",".join(self.schedules)),
        ]
        if json_path is not None:
            argv += ["--json", str(json_path)]
        if self.sweep is not None:
            argv += ["--sweep", str(self.sweep)]
        if self.traces is not None:
            argv += ["--traces", str(self.traces)]
        flags = ("--shaped-only", "--no-control", "--allow-uncalibrated")
        wanted = (self.shaped_only, not self.control, self.allow_uncalibrated)
        argv += [flag for flag, given in zip(flags, wanted, strict=True) if given]
        return [*argv, *self.overrides]

    def command(self, json_path: Path | str | None = None) -> str:
        """The command line that makes this measurement."""
        return command_line("experiments.cluster", self.cluster_argv(json_path))


@dataclass(frozen=True)
class ScheduleResult:
    """One schedule's figures; times in seconds, ``*_rounds_s`` one entry per round."""

    schedule: str
    step_s: float  # median over rounds
    step_min_s: float
    step_max_s: float
    step_rounds_s: tuple[float, ...]
    compute_only_s: float  # median over rounds on the free link (nan: not measured)
    compute_only_rounds_s: tuple[float, ...]
    exposed_communication_s: float  # median step - median compute-only
    tokens_per_s: float  # at the median step
    speedup: float  # median over rounds of baseline step / this step, same round
    speedup_min: float
    speedup_max: float


def schedule_results(
    shaped: dict[str, list[float]], free: dict[str, list[float]] | None, tokens_per_step: int
) -> list[ScheduleResult]:
    """Per-schedule figures from per-round times; the first schedule is the baseline of the
    speedups (each round's baseline step over the schedule's step in the same round)."""
    baseline = next(iter(shaped.values()))
    rows = []
    for schedule, rounds in shaped.items():
        step = Spread.of(rounds)
        free_rounds = () if free is None else tuple(free[schedule])
        compute = Spread.of(free_rounds).median if free_rounds else math.nan
        speedup = Spread.of(round_ratios(baseline, rounds))
        rows.append(
            ScheduleResult(
                schedule=schedule,
                step_s=step.median,
                step_min_s=step.low,
                step_max_s=step.high,
                step_rounds_s=tuple(rounds),
                compute_only_s=compute,
                compute_only_rounds_s=free_rounds,
                exposed_communication_s=step.median - compute,
                tokens_per_s=tokens_per_step / step.median,
                speedup=speedup.median,
                speedup_min=speedup.low,
                speedup_max=speedup.high,
            )
        )
    return rows


@dataclass(frozen=True)
class ScheduleMeasurement:
    """What ``measure_schedules`` measured, and how."""

    command: str
    request: ScheduleRequest
    config: Config
    calibration: LinkCalibration
    schedules: tuple[ScheduleResult, ...]
    communication_only_s: float  # the step's collectives alone on the shaped link (median)
    communication_only_free_link_s: float  # ... on the free link (nan: not measured)
    control: ControlResult | None

    def to_json(self) -> dict:
        """The results file's layout (``experiments.cluster --json``)."""
        request = self.request
        return {
            "command": self.command,
            "machine": machine(),
            "link_calibration": self.calibration.to_dict(),
            "hosts": request.hosts,
            "devices_per_host": request.devices_per_host,
            "link_mbit": request.link_mbit,
            "delay_ms": request.delay_ms,
            "preset": request.preset,
            "repeats": request.repeats,
            "warmup": request.warmup,
            "round_order": "listed order in even rounds, reversed in odd rounds",
            "config": self.config.to_dict(),
            "experimental": request.experimental.argv(),
            "communication_only_s": self.communication_only_s,
            "communication_only_free_link_s": self.communication_only_free_link_s,
            "schedules": [asdict(row) for row in self.schedules],
            "overlap_control": None if self.control is None else self.control.to_json(),
        }


def measure_schedules(request: ScheduleRequest, command: str | None = None) -> ScheduleMeasurement:
    """The measurement the module docstring describes; ``command``: what the results record
    as its command (default: the ``experiments.cluster`` command line of ``request``).

    Raises:
        ConfigError: from ``request.check()``.
        LinkNotCalibrated: the shaped link failed calibration and that was not allowed.
        HostRunFailed: a host program failed.
    """
    config = request.check()
    run_config = request.experimental.configure(config)  # the link told to its profile
    command = request.command() if command is None else command
    schedules, rounds = list(request.schedules), (request.repeats, request.warmup)
    control = None
    with tempfile.TemporaryDirectory(prefix="jaxmoe-cluster-") as tmp:
        workdir = Path(tmp)
        with calibrated_network(
            request.hosts, request.shaped_link, allow_uncalibrated=request.allow_uncalibrated
        ) as (network, calibration):
            hosts = EmulatedHosts(network, workdir, "shaped")
            if request.control:
                control = run_control(
                    hosts,
                    ControlSettings.for_cluster(
                        request.hosts,
                        request.devices_per_host,
                        request.link_mbit,
                        request.repeats,
                        request.warmup,
                    ),
                )
                print(control.summary(), flush=True)
            config_path = hosts.write_config(run_config)
            shaped = run_step_rounds(
                hosts,
                config_path,
                schedules,
                *rounds,
                trace=_traces(request, "shaped"),
                experimental=request.experimental,
            )
            communication = run_collectives_only(hosts, config_path, request.repeats)
            if request.sweep is not None:
                source = (
                    f"emulated cluster: {request.hosts} hosts x {request.devices_per_host} "
                    f"devices, {request.link_mbit:g} Mbit/s, {request.delay_ms:g} ms"
                )
                run_link_curves(hosts, run_config, request.sweep, source)
                record_calibration(request.sweep, calibration, command)
        free = free_communication = None
        if not request.shaped_only:
            with EmulatedNetwork(request.hosts, LinkShape(rate_mbit=None)) as network:
                hosts = EmulatedHosts(network, workdir, "free")
                config_path = hosts.write_config(run_config)
                free = run_step_rounds(
                    hosts,
                    config_path,
                    schedules,
                    *rounds,
                    trace=_traces(request, "free"),
                    experimental=request.experimental,
                )
                free_communication = run_collectives_only(hosts, config_path, request.repeats)
    tokens_per_step = config.train.batch_size * config.model.seq_len
    free_seconds = None if free is None else free.seconds
    return ScheduleMeasurement(
        command=command,
        request=request,
        config=config,
        calibration=calibration,
        schedules=tuple(schedule_results(shaped.seconds, free_seconds, tokens_per_step)),
        communication_only_s=communication.median_s,
        communication_only_free_link_s=(
            math.nan if free_communication is None else free_communication.median_s
        ),
        control=control,
    )


def _traces(request: ScheduleRequest, link: str) -> Path | None:
    """Where the steps on ``link`` (``shaped`` or ``free``) are traced, if anywhere."""
    return None if request.traces is None else request.traces / link


def record_calibration(path: Path, calibration: LinkCalibration, command: str) -> None:
    """Add the link's calibration (and the command) to a JSON results file written by another
    program on this cluster."""
    data = json.loads(path.read_text())
    data["link_calibration"] = calibration.to_dict()
    data.setdefault("command", command)
    path.write_text(json.dumps(data, indent=1) + "\n")


def format_table(report: dict) -> str:
    """A measurement (``ScheduleMeasurement.to_json()``, or a saved one) as a Markdown table:
    median [min-max] over rounds, and per-round speedups over the first schedule."""
    baseline = report["schedules"][0]["schedule"]
    header = (
        f"{report['hosts']} hosts x {report['devices_per_host']} devices, link "
        f"{report['link_mbit']:g} Mbit/s, delay {report['delay_ms']:g} ms, preset "
        f"{report['preset']}; {report['repeats']} interleaved rounds after "
        f"{report['warmup']} untimed, median [min-max]; {report['machine']}"
    )
    calibration = report.get("link_calibration")
    if calibration is not None:
        verdict = "calibrated" if calibration["passed"] else "NOT CALIBRATED"
        header += (
            f"\nlink {verdict}: a large message at {calibration['rate_fraction']:.1%} of the "
            f"rate, {calibration['pieces']} pieces {calibration['pieces_ratio']:.3f}x one message"
        )
    lines = [
        header,
        "",
        f"| schedule | step (ms) | speedup vs {baseline} (per round) | compute-only (ms) "
        "| communication-only (ms) | exposed communication (ms) | exposed / communication "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    communication = report["communication_only_s"]
    for row in report["schedules"]:
        step = Spread(row["step_s"], row["step_min_s"], row["step_max_s"])
        speedup = Spread(row["speedup"], row["speedup_min"], row["speedup_max"])
        lines.append(
            f"| {row['schedule']} | {step.format()} | {speedup.format(1, 3)} "
            f"| {row['compute_only_s'] * 1e3:.1f} "
            f"| {communication * 1e3:.1f} | {row['exposed_communication_s'] * 1e3:.1f} "
            f"| {row['exposed_communication_s'] / communication:.2f} "
            f"| {row['tokens_per_s']:,.0f} |"
        )
    residual_ms = report["communication_only_free_link_s"] * 1e3
    lines += ["", f"(communication-only on the free link: {residual_ms:.1f} ms)"]
    return "\n".join(lines)
