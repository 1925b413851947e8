"""Measured collective curves: fitting, evaluation, files, and their use by the cost model."""

import json

import pytest

from scheduling.costs.cost_model import CostModel
from scheduling.costs.link_model import CollectiveCurves, PiecewiseLinear
from scheduling.profiles import PROFILES
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
    with pytest.raises(ValueError, match="non-decreasing"):
        PiecewiseLinear((1.0, 2.0), (2.0, 1.0))
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        PiecewiseLinear((1.0, 2.0), (0.1, float("nan")))
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        PiecewiseLinear((1.0,), (-0.1,))


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


def _curve(**changes) -> dict:
    return {"kind": "psum", "group_size": 8, "bytes": [1, 2], "seconds": [0.1, 0.2], **changes}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", r"not valid JSON: .* \(line 1, column 2\)"),
        ("[]", r"expected an object \{"),
        ('{"source": "x"}', r"expected an object \{"),
        ('{"curves": {}}', r"expected an object \{"),
        ('{"curves": []}', "curves is empty"),
        (json.dumps({"source": 3, "curves": [_curve()]}), "source must be a string"),
        (json.dumps({"curves": [7]}), r"curves\[0\] must be an object"),
        (json.dumps({"curves": [{"kind": "psum"}]}), "lacks group_size, bytes, seconds"),
        (json.dumps({"curves": [_curve(kind="alltoall")]}), "'alltoall' is not a collective"),
        (json.dumps({"curves": [_curve(kind=["psum"])]}), "is not a collective"),
        (json.dumps({"curves": [_curve(group_size=1)]}), "group_size=1: must be an integer >= 2"),
        (json.dumps({"curves": [_curve(group_size="8")]}), "group_size='8'"),
        (json.dumps({"curves": [_curve(bytes=[])]}), "bytes must be a non-empty list"),
        (json.dumps({"curves": [_curve(seconds=["0.1", 0.2])]}), "seconds must be a non-empty"),
        (json.dumps({"curves": [_curve(seconds=[0.1])]}), "as many sizes as times"),
        (json.dumps({"curves": [_curve(bytes=[2, 1])]}), "strictly increasing"),
        (json.dumps({"curves": [_curve(seconds=[0.3, 0.2])]}), "non-decreasing"),
        (
            '{"curves": [{"kind": "psum", "group_size": 8, "bytes": [1], "seconds": [NaN]}]}',
            "finite",
        ),
        (
            json.dumps({"curves": [_curve(), _curve()]}),
            r"curves\[1\]: a second curve for psum over 8",
        ),
    ],
)
def test_a_file_the_cost_model_cannot_use_is_refused_with_the_place(tmp_path, content, message):
    path = tmp_path / "curves.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        CollectiveCurves.load(path)


def test_an_unreadable_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        CollectiveCurves.load(tmp_path / "absent.json")
    with pytest.raises(IsADirectoryError):
        CollectiveCurves.load(tmp_path)
