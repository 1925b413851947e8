"""Measured collective curves: fitting, evaluation, files, and their use by the cost model."""

import pytest

from scheduling.cost import PROFILES, CostModel
from scheduling.link_model import CollectiveCurves, PiecewiseLinear
from tests.scheduling.toys import toy_program


def test_fit_takes_medians_and_never_lets_more_bytes_cost_less():
    curve = PiecewiseLinear.fit([(100, 1.0), (100, 3.0), (100, 2.0), (200, 1.5), (400, 4.0)])
    assert curve.sizes == (100.0, 200.0, 400.0)
    assert curve.seconds == (2.0, 2.0, 4.0)  # median 2.0; 1.5 raised to 2.0


def test_interpolates_extrapolates_and_floors_at_the_smallest_size():
    curve = PiecewiseLinear((100.0, 200.0, 400.0), (1.0, 2.0, 4.0))
    assert curve(50) == 1.0 and curve(100) == 1.0
    assert curve(150) == pytest.approx(1.5)
    assert curve(200) == pytest.approx(2.0)
    assert curve(800) == pytest.approx(8.0)  # last segment's slope
    assert PiecewiseLinear((10.0,), (3.0,))(1e9) == 3.0


def test_invalid_curves_are_refused():
    with pytest.raises(ValueError, match="strictly increasing"):
        PiecewiseLinear((2.0, 1.0), (1.0, 2.0))
    with pytest.raises(ValueError, match="as many sizes as times"):
        PiecewiseLinear((1.0,), ())


def test_curves_round_trip_through_a_file(tmp_path):
    curves = CollectiveCurves("test", {("psum", 8): PiecewiseLinear((1.0, 2.0), (0.1, 0.2))})
    curves.save(tmp_path / "curves.json")
    loaded = CollectiveCurves.load(tmp_path / "curves.json")
    assert loaded == curves
    assert loaded.seconds("psum", 8, 1.5) == pytest.approx(0.15)
    assert loaded.seconds("psum", 4, 1.5) is None


def test_cost_model_uses_a_curve_where_one_covers_the_collective():
    program = toy_program()
    axes = dict(program.mesh.shape)
    (group,) = axes.values()
    collectives = program.collectives()
    kinds = {op.primitive for op in collectives}
    assert "all_to_all" in kinds and "psum" in kinds
    curves = CollectiveCurves("test", {("all_to_all", group): PiecewiseLinear((1.0,), (0.5,))})
    measured = CostModel(PROFILES["cpu"], axes, curves)
    analytic = CostModel(PROFILES["cpu"], axes)
    for op in collectives:
        if op.primitive == "all_to_all":
            assert measured.collective_seconds(op) == 0.5
        else:
            assert measured.collective_seconds(op) == analytic.collective_seconds(op)
