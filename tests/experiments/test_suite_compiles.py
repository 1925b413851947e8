"""The suite's compile record (experiments/suite_compiles.py): a compile is recorded against
the test that caused it, and the report ranks tests, files and functions by seconds."""

import json

import jax
import jax.numpy as jnp

from experiments import suite_compiles


def _record(test, event, function, seconds):
    return {"test": test, "event": event, "function": function, "seconds": seconds}


def test_a_compile_is_recorded_against_the_running_test(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::test_b[c] (call)")
    recorder = suite_compiles.Recorder(tmp_path / "1.jsonl")
    recorder.start()
    try:
        # A function of its own, so that no cache of this process has it.
        def recorded_by_the_suite_compiles_test(x):
            return jnp.sin(x) * 3.0

        jax.jit(recorded_by_the_suite_compiles_test)(jnp.ones(3))
    finally:
        recorder.stop()
    records = suite_compiles.read_records(tmp_path)
    events = {r["event"] for r in records if r["function"] == "recorded_by_the_suite_compiles_test"}
    assert events == {"trace", "lower", "compile"}
    assert {r["test"] for r in records} == {"tests/a.py::test_b[c]"}
    assert all(r["seconds"] >= 0 for r in records)


def test_the_report_ranks_by_seconds_and_counts_events(tmp_path):
    records = [
        _record("tests/x.py::test_one", "compile", "jit_step", 3.0),
        _record("tests/x.py::test_one", "compile", "jit_init", 1.0),
        _record("tests/y.py::test_two", "compile", "jit_step", 2.5),
        _record("tests/y.py::test_two", "trace", "step", 0.5),
        _record(suite_compiles.OUTSIDE, "lower", "step", 0.25),
    ]
    (tmp_path / "7.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "report.md"
    assert suite_compiles.main(["--records", str(tmp_path), "--top", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| compile | 6.5 | 3 |" in text and "| trace | 0.5 | 1 |" in text
    assert "| lower | 0.2 | 1 |" in text
    by_test = text.split("### Compile, by test\n")[1].split("###")[0]
    assert by_test.index("tests/x.py::test_one") < by_test.index("tests/y.py::test_two")
    assert "| `tests/x.py::test_one` | 4.0 | 2 |" in by_test
    assert "| `jit_step` | 5.5 | 2 |" in text
    assert f"--records {tmp_path}" in text


def test_no_records_is_said_in_one_line(tmp_path, capsys):
    assert suite_compiles.main(["--records", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
