"""The schedule section: :mod:`experiments.gpu_schedule_check` on JAX's mock topology of 8
GPUs (windows kept, all-to-alls overlapped, step times of ``none``, ``lancet`` and
``pair``), in a process of its own: the mock topology must be chosen before JAX starts its
backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from experiments.gpu_check.setup import ROOT, Budget, Setup
from experiments.shared.results_file import command_line
from experiments.shared.spread import Spread

SCHEDULE_ARGS = (
    "--mock-devices", "8", "--layers", "2", "--schedules", "none,lancet,pair",
    "--steps", "3", "--rounds", "2",
)  # fmt: skip


def measure(setup: Setup, budget: Budget, found: dict[str, Any]) -> dict[str, Any]:
    """experiments.gpu_schedule_check on the mock topology, in a process of its own."""
    out = setup.out / "gpu_schedule_check.md"
    argv = [*SCHEDULE_ARGS, "--out", str(out)]
    found["command"] = command_line("experiments.gpu_schedule_check", argv)
    found["results_file"] = str(out)
    if setup.dry:
        found["skipped"] = (
            "gpu_schedule_check refuses CPU devices (XLA:CPU runs async collectives "
            "synchronously): not run in the dry run"
        )
        return found
    written = out.with_suffix(".json")
    written.unlink(missing_ok=True)  # an earlier run's figures are not this one's
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    command = [sys.executable, "-m", "experiments.gpu_schedule_check", *argv]
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=max(1.0, budget.left() - 5),
        )  # fmt: skip
        found["returncode"] = done.returncode
        found["output_tail"] = (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as expired:
        found["error"] = f"gpu_schedule_check ran past {expired.timeout:.0f} s and was stopped"
        found["output_tail"] = _text(expired.stdout)[-3000:] + _text(expired.stderr)[-3000:]
    if written.exists():
        found["results"] = json.loads(written.read_text())
    return found


def _text(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def report(found: dict[str, Any]) -> list[str]:
    lines = [f"Command: `{found.get('command', '')}` (its own file: `{found.get('results_file')}`)"]
    if "skipped" in found:
        return [*lines, "", f"Skipped: {found['skipped']}.", ""]
    if found.get("returncode"):
        lines.append(f"\nIt exited with status {found['returncode']}.")
    lines += [
        "",
        "| schedule | windows kept | all-to-alls overlapped | compile s | step ms |",
        "|---|---|---|---|---|",
    ]
    for name, result in found.get("results", {}).items():
        if "error" in result:
            lines.append(f"| {name} | {result['error'].splitlines()[0][:120]} ||||")
            continue
        seconds = result.get("seconds")
        step_ms = Spread.of(seconds).format() if seconds else "-"
        lines.append(
            f"| {name} | {result['kept']} of {result['groups']} | {result['overlapped']} of "
            f"{result['all_to_alls']} | {result['compile_s']:.1f} | {step_ms} |"
        )
    return [*lines, ""]
