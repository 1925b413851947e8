"""The overlap control on its own: does this cluster overlap communication with computation?

    sudo python -m experiments.overlap_control [--collectives socket|xla] [--json FILE]
        [--hosts 2 --devices-per-host 1] [--link-mbit 200] [--rows 2048 --width 512
        --layers 1 --chunks 8] [--repeats 10 --warmup 2] [--allow-uncalibrated]

Runs the control of ``experiments.emulation.overlap_control`` (matmuls -> all_to_all ->
matmuls per device in three forms: ``independent`` chunks, ``chained`` chunks,
``unchunked``) on emulated hosts joined by a calibrated, shaped link (refused when the
link fails calibration unless ``--allow-uncalibrated``). ``--json`` writes the per-round
step times in milliseconds under ``independent``, ``chained`` and ``unchunked``, with the
settings, the link's calibration and the command.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from experiments.emulation.hosts import EmulatedHosts
from experiments.emulation.link_calibration import LinkNotCalibrated, calibrated_network
from experiments.emulation.network import LinkShape, namespaces_available
from experiments.emulation.overlap_control import (
    COLLECTIVES,
    ControlProgram,
    ControlSettings,
    run_control,
)
from experiments.shared.results_file import command_line


def _settings(args: argparse.Namespace) -> ControlSettings:
    program = ControlProgram(args.collectives, args.rows, args.width, args.layers, args.chunks)
    return ControlSettings(
        program, args.hosts, args.devices_per_host, args.link_mbit, args.repeats, args.warmup
    )


def main(argv: list[str] | None = None) -> int:
    default = ControlSettings()
    parser = argparse.ArgumentParser(
        prog="python -m experiments.overlap_control", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--collectives", choices=COLLECTIVES, default=default.program.collectives)
    parser.add_argument("--rows", type=int, default=default.program.rows, help="rows per device")
    parser.add_argument("--width", type=int, default=default.program.width)
    parser.add_argument(
        "--layers", type=int, default=default.program.layers, help="matmuls before and after"
    )
    parser.add_argument("--chunks", type=int, default=default.program.chunks)
    parser.add_argument("--repeats", type=int, default=default.repeats, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=default.warmup, help="untimed rounds")
    parser.add_argument("--hosts", type=int, default=default.hosts)
    parser.add_argument("--devices-per-host", type=int, default=default.devices_per_host)
    parser.add_argument("--link-mbit", type=float, default=default.link_mbit)
    parser.add_argument("--allow-uncalibrated", action="store_true")
    parser.add_argument("--json", type=Path, help="write the per-round times (ms) here")
    args = parser.parse_args(argv)
    try:
        settings = _settings(args)
        link = LinkShape(rate_mbit=args.link_mbit)
    except ValueError as error:
        parser.error(str(error))
    available, reason = namespaces_available()
    if not available:
        print(f"overlap_control: cannot create network namespaces: {reason}", file=sys.stderr)
        return 2
    command = command_line("experiments.overlap_control", sys.argv[1:] if argv is None else argv)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="jaxmoe-control-") as tmp,
            calibrated_network(args.hosts, link, allow_uncalibrated=args.allow_uncalibrated) as (
                network,
                calibration,
            ),
        ):
            result = run_control(EmulatedHosts(network, Path(tmp), "shaped"), settings)
    except LinkNotCalibrated:
        return 3
    print(result.summary())
    if args.json is not None:
        report = {"command": command, **result.to_json()}
        report["link_calibration"] = calibration.to_dict()
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
