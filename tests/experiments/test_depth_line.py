"""The depth line's check (experiments/depth_line.py): each line through two traced depths,
and the table's errors against the deepest trace."""

import pytest

from experiments import depth_line


def test_the_lines_run_through_their_two_depths():
    steps = [1.0, 3.0, 4.5, 6.0]  # the second block adds 2.0, each later one 1.5
    assert depth_line.line(steps, 1, 4) == 7.0
    assert depth_line.line(steps, 2, 4) == 6.0
    assert depth_line.line(steps, 2, 28) == pytest.approx(3.0 + 26 * 1.5)


def test_a_line_may_run_through_depths_further_apart():
    steps = [1.0, 3.0, 4.5, 5.5, 7.5]  # from two blocks to five: 1.5 a block on average
    assert depth_line.line(steps, 2, 5, 5) == 7.5
    assert depth_line.line(steps, 2, 28, 5) == pytest.approx(3.0 + 26 * 1.5)


def test_the_table_gives_what_each_block_adds_and_each_lines_error():
    case = depth_line.Case("at its recipe", "qwen2-57b-a14b", 64, 256, dict(expert=16))
    steps = {
        "lancet": [0.100, 0.160, 0.210, 0.260],
        "pair": [0.100, 0.150, 0.190, 0.250],
    }
    depths = {"lancet": (2, 3), "pair": (2, 8)}
    text = depth_line.render([(case, 28, steps, depths)], ["--blocks", "4"])
    assert "## qwen2-57b-a14b at its recipe (64 devices, 256 sequences, expert 16; 28 blocks)" in (
        text
    )
    assert (
        "| `lancet` | 100.0, 160.0, 210.0, 260.0 | 60.00, 50.00, 50.00 | 280.0 (+7.69%) "
        "| 260.0 (+0.00%) | 260.0 (+0.00%) | 1720 | 1460 | 2-3: 1460 |"
    ) in text
    # The paired line runs to eight blocks, deeper than the traces.
    assert (
        "| `pair` | 100.0, 150.0, 190.0, 250.0 | 50.00, 40.00, 60.00 "
        "| 250.0 (-0.00%) | 230.0 (-8.00%) | 2-8: not traced | 1450 | 1190 | |"
    ) in text


def test_the_packing_table_gives_each_packings_steps_and_peaks():
    case = depth_line.Case("at its recipe", "qwen2-57b-a14b", 64, 256, dict(expert=8))
    found = {
        (True, 0.1): [(0.100, 1.05), (0.150, 1.10)],
        (False, float("inf")): [(0.110, 1.0), (0.160, 1.0)],
        (None, float("inf")): [(0.120, 1.0), (0.180, 1.02)],
    }
    text = depth_line.render_packing(case, found)
    assert "## dW packing at depth: qwen2-57b-a14b at its recipe (expert 8), `dw`" in text
    assert "| forced | 10% | 100.0, 150.0 | 50.00 | 1.05x, 1.10x |" in text
    assert "| unforced | none | 110.0, 160.0 | 50.00 | 1.00x, 1.00x |" in text
    assert "| nothing placed | none | 120.0, 180.0 | 60.00 | 1.00x, 1.02x |" in text


def test_only_the_schedules_the_planner_weighs_are_traced(capsys):
    with pytest.raises(SystemExit) as exited:
        depth_line.main(["--schedules", "pair,bogus"])
    assert exited.value.code == 2
    assert "--schedules 'pair,bogus': choose from none, dw, lancet, pair" in capsys.readouterr().err
