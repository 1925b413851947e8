"""The planner's order of estimates (experiments/plan_order.py): its results file says how
many of the proven best each search had estimated by each time and whether both searches
proved the same best; the source it sends to the other tree runs on its own."""

from experiments import plan_order
from experiments.shared.other_tree import unbound_names

ARGV = ["--against", "/elsewhere"]


def _search(
    stamps: dict[str, float], ranked: list[tuple[str, float]], wall=700.0, tightened=()
) -> dict:
    return {
        "wall": wall,
        "cpu": 2 * wall,
        "estimated": [[stamp, label] for label, stamp in stamps.items()],
        "tightened": list(tightened),
        "complete": True,
        "ranked": [[label, step, "lancet"] for label, step in ranked],
    }


def _report(this, other, limited):
    """``limited``: this tree's search with a time limit; the other's estimated nothing."""
    both = [limited, _search({}, [], wall=65.0)]
    commits = ("def456 new", "abc123 old")
    return plan_order.report(this, other, both, commits, ARGV, "small", 64, "a100", 60.0)


def test_the_results_say_how_many_of_the_best_each_search_had_by_each_time():
    ranked = [("best", 0.004), ("second", 0.005)]
    this = _search({"best": 50.0, "second": 100.0, "slow": 20.0}, ranked, tightened=[10.0])
    other = _search(
        {"slow": 30.0, "second": 200.0, "best": 400.0}, ranked, tightened=[10, 20, 25, 40]
    )
    limited = _search({"best": 50.0}, [("best", 0.004)], wall=61.0)
    text = _report(this, other, limited)
    assert "| this | 700 | 1400 | 3 | 1 | 1 | 20 | 4.000 |" in text
    assert "| other | 700 | 1400 | 3 | 4 | 3 | 30 | 4.000 |" in text
    assert "| 60 | 1 | 4.000 | 0 | - |" in text
    assert "| 120 | 2 | 4.000 | 0 | - |" in text
    assert "| 300 | 2 | 4.000 | 1 | 5.000 |" in text
    assert "| 600 | 2 | 4.000 | 2 | 4.000 |" in text
    assert "estimated at 50 s by this tree, 400 s by the other" in text
    assert "All 2 best: by 100 s and 400 s." in text
    assert "The same 2 best, in the same order: yes." in text
    assert "| this | 61 | 122 | 1 | best (the proven best) | 4.000 | 1 of 1 |" in text
    assert "| other | 65 | 130 | 0 | none | - | 0 of 0 |" in text
    # The other tree is named by its commit, not by where it was checked out.
    assert "--against DIR" in text and "/elsewhere" not in text


def test_searches_that_prove_different_best_are_said_to():
    this = _search({"a": 1.0, "b": 2.0}, [("a", 0.004), ("b", 0.005)])
    other = _search({"a": 1.0, "b": 2.0}, [("b", 0.004), ("a", 0.005)])
    limited = _search({"b": 1.0}, [("b", 0.005)])
    text = _report(this, other, limited)
    assert "The same 2 best, in the same order: no." in text
    assert "| b | 5.000 | 1 of 1 |" in text  # not the proven best, yet among the best


def test_the_search_reads_no_name_of_its_module():
    """It runs in another tree as source alone: every name it reads is its own, an
    argument, an import inside it, or a builtin."""
    assert unbound_names(plan_order._search) == set()
