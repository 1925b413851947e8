"""The optimizer's share of a small step (experiments/optimizer_share.py): the report of
rounds measured side by side."""

from experiments import optimizer_share


def test_the_report_gives_each_round_and_the_ratios_per_round():
    rounds = [
        {
            "adamw": {"equations": 100, "capture": 1.0, "compile": 4.0},
            "sgd": {"equations": 75, "capture": 0.5, "compile": 3.0},
        },
        {
            "adamw": {"equations": 100, "capture": 2.0, "compile": 5.0},
            "sgd": {"equations": 75, "capture": 1.5, "compile": 4.5},
        },
    ]
    text = optimizer_share.report(rounds, ["--rounds", "2"])
    assert "`python -m experiments.optimizer_share --rounds 2`" in text
    assert "| 2 | sgd | 75 | 1.50 | 4.50 |" in text
    # Ratios are taken round by round (0.5 and 0.75), not of the medians.
    assert "SGD / AdamW 0.62 [0.50-0.75]" in text
    assert "SGD / AdamW 0.82 [0.75-0.90]" in text
    assert "equations: AdamW 100, SGD 75 (0.75)" in text
