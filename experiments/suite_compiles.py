"""Where the test suite's time goes, program by program: a pytest plugin that records JAX's
trace, lowering and backend-compile durations against the test that caused them, and the
report of those records.

    .venv/bin/python -m pytest -p experiments.suite_compiles -n auto --dist loadscope
    .venv/bin/python -m experiments.suite_compiles [--records DIR] [--top N]

Each process of the run (pytest and each xdist worker) appends one JSON line per event to
a file of its own under ``$SUITE_COMPILES_DIR`` (default ``runs/suite_compiles``), emptied
by the process that starts the run; the report reads them there (or from ``--records``).
The durations are JAX's own (:mod:`jax.monitoring`, wall seconds in the process that
traced or compiled): a compile the persistent cache answered is counted too, as the time
of its read. The processes tests start are not recorded. The report is written to
``experiments/results/suite_compiles.md`` with the command that made it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from experiments.shared.results_file import command_line

RECORDS = Path("runs/suite_compiles")
RESULTS = Path("experiments/results/suite_compiles.md")
# JAX's duration events, by the name the report gives them.
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
OUTSIDE = "(outside any test)"


class Recorder:
    """Appends JAX's trace, lowering and compile durations to ``path`` as JSON lines, each
    with the test running in this process (pytest's ``PYTEST_CURRENT_TEST``)."""

    def __init__(self, path: Path):
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in stop)

    def start(self) -> None:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def stop(self) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        self._file.close()

    def _on_duration(self, event: str, seconds: float, **fields) -> None:
        kind = EVENTS.get(event)
        if kind is None:
            return
        current = os.environ.get("PYTEST_CURRENT_TEST", "")
        test = current.rsplit(" (", 1)[0] if current else OUTSIDE
        function = str(fields.get("fun_name", "?"))
        if function.startswith("jit(") and function.endswith(")"):
            function = function[4:-1]  # the lowering's and the compile's name of a jit
        record = {"test": test, "event": kind, "function": function, "seconds": seconds}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def _records_dir() -> Path:
    return Path(os.environ.get("SUITE_COMPILES_DIR", RECORDS))


def pytest_configure(config) -> None:
    directory = _records_dir()
    if not hasattr(config, "workerinput"):  # the process that starts the run
        shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(directory / f"{os.getpid()}.jsonl")
    recorder.start()
    config._suite_compiles = recorder


def pytest_unconfigure(config) -> None:
    recorder = getattr(config, "_suite_compiles", None)
    if recorder is not None:
        recorder.stop()


def read_records(directory: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(directory.glob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line
    ]


def _table(title: str, rows: Iterable[tuple[str, float, int]], key: str) -> list[str]:
    lines = [f"### {title}", "", f"| {key} | seconds | events |", "|---|---|---|"]
    lines += [f"| `{name}` | {seconds:.1f} | {count} |" for name, seconds, count in rows]
    return [*lines, ""]


def _top(records: Sequence[dict], key, top: int) -> list[tuple[str, float, int]]:
    seconds, counts = collections.Counter(), collections.Counter()
    for record in records:
        seconds[key(record)] += record["seconds"]
        counts[key(record)] += 1
    return [(name, total, counts[name]) for name, total in seconds.most_common(top)]


def report(records: Sequence[dict], top: int) -> list[str]:
    """The totals of each event, then the tests, test files and jitted functions whose
    compiles took longest (and the tests whose traces did)."""
    by_event = collections.defaultdict(list)
    for record in records:
        by_event[record["event"]].append(record)
    lines = ["| event | seconds | events |", "|---|---|---|"]
    for kind in EVENTS.values():
        chosen = by_event[kind]
        lines.append(f"| {kind} | {sum(r['seconds'] for r in chosen):.1f} | {len(chosen)} |")
    lines.append("")
    compiles, traces = by_event["compile"], by_event["trace"]
    lines += _table("Compile, by test", _top(compiles, lambda r: r["test"], top), "test")
    lines += _table(
        "Compile, by test file", _top(compiles, lambda r: r["test"].split("::")[0], top), "file"
    )
    lines += _table(
        "Compile, by jitted function", _top(compiles, lambda r: r["function"], top), "function"
    )
    lines += _table("Trace, by test", _top(traces, lambda r: r["test"], top), "test")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=Path, default=_records_dir())
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    records = read_records(args.records)
    if not records:
        hint = "run the suite with -p experiments.suite_compiles first"
        print(f"no records under {args.records}: {hint}", file=sys.stderr)
        return 2
    command = command_line("experiments.suite_compiles", argv if argv is not None else sys.argv[1:])
    text = [
        "# Where the suite's JAX time goes",
        "",
        "Recorded with `python -m pytest -p experiments.suite_compiles -n auto --dist "
        "loadscope`, reported with",
        f"`{command}`.",
        "Wall seconds inside the worker processes; the processes tests start are not recorded.",
        "",
        *report(records, args.top),
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(text), encoding="utf-8")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
