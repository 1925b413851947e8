"""A function called in a fresh process with its own number of CPU devices."""

import pytest

from experiments.shared.device_process import call_with_devices


def devices_and_echo(value: dict) -> dict:
    import jax

    return {"devices": jax.device_count(), "value": value}


def fail() -> None:
    raise ValueError("in the child")


def test_the_function_runs_with_the_devices_asked_for_and_returns_its_result():
    # This process has 8 devices (tests/conftest.py); the child gets 3.
    assert call_with_devices(3, devices_and_echo, {"a": [1, 2]}) == {
        "devices": 3,
        "value": {"a": [1, 2]},
    }


def test_a_failure_in_the_child_is_an_error_here():
    with pytest.raises(RuntimeError, match="fail on 2 devices failed"):
        call_with_devices(2, fail)
