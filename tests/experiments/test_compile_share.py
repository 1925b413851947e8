"""What a small step's compile is made of (experiments/compile_share.py): the report of
rounds measured side by side."""

from experiments import compile_share
from experiments.shared.other_tree import unbound_names


def _figures(*values):
    """One measurement's figures, in the order the experiment names them."""
    return dict(zip(compile_share.COUNTS + compile_share.SECONDS, values, strict=True))


def test_the_report_gives_each_round_and_the_ratios_per_round():
    rounds = [
        {
            "adamw": _figures(29, 100, 400, 1.0, 4.0, 1.0),
            "sgd": _figures(29, 75, 300, 0.5, 3.0, 1.0),
            "lean": _figures(18, 80, 320, 0.8, 3.2, 0.9),
        },
        {
            "adamw": _figures(29, 100, 400, 2.0, 5.0, 2.0),
            "sgd": _figures(29, 75, 300, 1.5, 4.5, 1.0),
            "lean": _figures(18, 80, 320, 1.0, 4.0, 1.0),
        },
    ]
    text = compile_share.report(rounds, ["--rounds", "2"])
    assert "`python -m experiments.compile_share --rounds 2`" in text
    assert "| 2 | sgd | 29 | 75 | 300 | 1.50 | 4.50 | 1.00 |" in text
    assert "- lean: parameters 18 against 29 (0.62), equations 80 against 100 (0.80)" in text
    # Ratios are taken round by round (0.75 and 0.90), not of the medians.
    assert "sgd / adamw 0.82 [0.75-0.90]" in text
    # lean's init compile: 0.9 and 0.5 of the reference's.
    assert "lean / adamw 0.70 [0.50-0.90]" in text


def test_the_measurement_reads_no_name_of_its_module():
    """It runs in a process of its own as source alone."""
    assert unbound_names(compile_share._measure) == set()
