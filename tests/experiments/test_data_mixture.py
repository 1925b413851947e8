"""The data-mixture experiment on a few steps: its counts are the pipeline's, exactly (the
full run is a measurement, in experiments/results/)."""

from experiments.data_mixture import grain_shares, main


def test_grains_shares_scale_the_smallest_weight_to_100():
    assert grain_shares((3.0, 1.0)) == [300, 100]
    assert grain_shares((0.7, 0.3)) == [233, 100]


def test_a_few_steps_count_each_corpus_exactly(tmp_path):
    out = tmp_path / "mixture.md"
    argv = ["--steps", "3", "--weights", "3:1", "--max-bytes", "200000", "--out", str(out)]
    assert main(argv) == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith("| 3 : 1 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:6] == ["300 : 100", "96", "72", "24", "25.0000%"]
    assert cells[9] == "8-8"
