"""A failed save is the run's one line: Orbax's and TensorStore's reports of it are dropped,
and nothing else is."""

import asyncio
import gc
import logging
import sys
from types import SimpleNamespace

import tensorstore as ts

from jaxmoe.train.failed_saves import quiet_failed_saves


def _write_ending_after_its_loop_closed() -> None:
    """A TensorStore future awaited in an event loop that closes before it resolves, as
    Orbax leaves a save's other writes when one of them fails."""
    promise, future = ts.Promise.new()
    loop = asyncio.new_event_loop()

    async def write() -> None:
        await future

    loop.set_exception_handler(lambda loop, context: None)  # the task left pending
    pending = loop.create_task(write())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    promise.set_result(None)
    assert not pending.done()


def _error_no_one_awaits() -> None:
    loop = asyncio.new_event_loop()
    loop.create_future().set_exception(ValueError("RESOURCE_EXHAUSTED: Error writing"))
    gc.collect()  # asyncio reports the error when the future is collected
    loop.close()


def test_reports_of_writes_a_failed_save_left_behind_are_dropped(monkeypatch, caplog):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(logging.getLogger("asyncio"), "filters", [])
    _write_ending_after_its_loop_closed()
    _error_no_one_awaits()
    assert [str(report.exc_value) for report in unraisable] == ["Event loop is closed"]
    assert "Future exception was never retrieved" in caplog.text

    unraisable.clear()
    caplog.clear()
    quiet_failed_saves()
    quiet_failed_saves()  # installed once
    _write_ending_after_its_loop_closed()
    _error_no_one_awaits()
    assert unraisable == [] and caplog.records == []

    # Everything else still reaches the hook and the log.
    sys.unraisablehook(SimpleNamespace(exc_value=RuntimeError("another"), object=None))
    logging.getLogger("asyncio").error("another")
    assert [str(report.exc_value) for report in unraisable] == ["another"]
    assert [record.getMessage() for record in caplog.records] == ["another"]
