"""The validation's tables: the error of each prediction against the measured step."""

from experiments import simulator_validation


def test_table_gives_each_schedule_its_error_in_both_readings():
    measured = {
        "schedules": [{"schedule": "none", "step_s": 2.0}, {"schedule": "lancet", "step_s": 1.6}],
        "communication_only_s": 1.5,
    }

    def guess(step, in_place):
        return {
            "step_s": step,
            "compute_s": 0.5,
            "communication_s": 1.5,
            "exposed_s": step - 0.5,
            "in_place_step_s": in_place,
        }

    predicted = {"none": guess(2.2, 2.2), "lancet": guess(1.8, 2.4)}
    lines = simulator_validation._table("tiny", measured, predicted)
    (none,) = [line for line in lines if line.startswith("| none |")]
    (lancet,) = [line for line in lines if line.startswith("| lancet |")]
    assert "| +10.0% |" in none  # 2.2 / 2.0 - 1
    assert "| +12.5% |" in lancet  # 1.8 / 1.6 - 1
    assert lancet.endswith("| 2400.0 | +50.0% |")  # in place: 2.4 / 1.6 - 1
    assert lines[-1].endswith("1500.0 ms.")


def test_cluster_runs_use_the_layout_of_each_preset(tmp_path):
    argv = simulator_validation.cluster_argv("small", True, tmp_path / "m", tmp_path / "c")
    flags = dict(zip(argv[::2], argv[1::2], strict=False))
    assert (flags["--parallel.data"], flags["--parallel.expert"]) == ("2", "4")
    assert flags["--schedules"] == "none,dw,partition,lancet"
    assert flags["--sweep"] == str(tmp_path / "c")
