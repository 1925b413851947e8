"""The planner traces with the collector at its own pace, and leaves the caller's as it was."""

import gc

import pytest

from jaxmoe.plan import collector, planner
from jaxmoe.presets import preset


@pytest.fixture
def unfrozen():
    """A heap with nothing set aside (the suite's conftest freezes the modules it loads),
    frozen again as it was afterwards."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    yield
    if frozen:
        gc.freeze()


def test_the_pace_holds_inside_and_is_restored_after(unfrozen):
    before = gc.get_threshold()
    seen = {}

    @collector.collecting_less
    def inside(value):
        seen["threshold"], seen["frozen"] = gc.get_threshold(), gc.get_freeze_count()
        return value * 2

    assert inside(21) == 42
    assert seen["threshold"] == collector.THRESHOLDS
    assert seen["frozen"] > 0  # the heap before the call set aside
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_raising_call_restores_the_pace_too(unfrozen):
    before = gc.get_threshold()

    @collector.collecting_less
    def failing():
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        failing()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def _set_aside(value) -> bool:
    """Whether the collector holds ``value`` set aside: tracked, and in none of the
    generations it examines. (The count of what is set aside is no witness: an object set
    aside is still freed when nothing refers to it.)"""
    examined = (obj for generation in range(3) for obj in gc.get_objects(generation))
    return gc.is_tracked(value) and not any(obj is value for obj in examined)


def test_what_the_caller_set_aside_stays_set_aside(unfrozen):
    kept = [object()]
    gc.freeze()
    assert _set_aside(kept)
    collector.collecting_less(lambda: None)()
    assert _set_aside(kept)
    gc.unfreeze()
    assert not _set_aside(kept)


def test_the_planner_runs_at_that_pace(monkeypatch):
    seen = []

    def check(*args):
        seen.append(gc.get_threshold())
        raise RuntimeError("stop here")

    monkeypatch.setattr(planner, "check_plan_inputs", check)
    with pytest.raises(RuntimeError, match="stop here"):
        planner.plan_mappings(preset("tiny"), "tiny", 8, "h100-8x-nvlink-3200g")
    assert seen == [collector.THRESHOLDS]
