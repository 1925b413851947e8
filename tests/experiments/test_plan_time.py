"""The planner-time comparison (experiments/plan_time.py): its results file states each
round's ratio and the spread, of pricing and of tracing, and says whether both trees
priced and traced the programs alike; the source it sends to the other tree runs on its
own."""

from experiments import plan_time
from experiments.shared.other_tree import unbound_names

ARGV = ["--against", "/elsewhere"]


def _side(seconds, digest="abc", traced=None, trace_digest="123"):
    side = {"seconds": seconds, "digests": [digest], "programs": 6}
    if traced is not None:
        side.update(trace_seconds=traced, trace_digest=trace_digest)
    return side


def test_the_results_give_each_rounds_ratio_and_the_spread():
    rounds = [(_side([1.0, 1.2, 1.1]), _side([2.2, 2.0, 2.4])), (_side([2.0]), _side([3.0]))]
    text = plan_time.report(rounds, "def456 new", "abc123 old", "small", ARGV)
    assert "| 1 | 1.10 | 2.20 | 2.00 |" in text
    assert "| 2 | 2.00 | 3.00 | 1.50 |" in text
    assert "other / this 1.75 [1.50-2.00]" in text
    assert "Priced alike (the simulated steps' digests equal): yes." in text
    # The other tree is named by its commit, not by where it was checked out.
    assert "--against DIR" in text and "/elsewhere" not in text


def test_a_difference_in_what_was_priced_is_said():
    rounds = [(_side([1.0]), _side([2.0], digest="def"))]
    text = plan_time.report(rounds, "def456 new", "abc123 old", "small", ARGV)
    assert "Priced alike (the simulated steps' digests equal): no (2 digests)." in text


def test_the_measurement_reads_no_name_of_its_module():
    """It runs in another tree as source alone: every name it reads is its own, an
    argument, an import inside it, or a builtin."""
    assert unbound_names(plan_time._measure) == set()


def test_the_tracing_table_gives_each_recomputations_ratio():
    rounds = [
        (
            _side([1.0], traced={"none": 2.0, "layer": 1.0}),
            _side([1.0], traced={"none": 2.0, "layer": 1.5}),
        ),
        (
            _side([1.0], traced={"none": 1.0, "layer": 1.0}),
            _side([1.0], traced={"none": 1.1, "layer": 2.0}),
        ),
    ]
    text = plan_time.report(rounds, "def456 new", "abc123 old", "small", ARGV)
    assert "| 1 | layer | 1.00 | 1.50 | 1.50 |" in text
    assert "| 2 | none | 1.00 | 1.10 | 1.10 |" in text
    assert (
        "- `layer`: this tree 1.00 [1.00-1.00] s, the other 1.75 [1.50-2.00] s; "
        "other / this 1.75 [1.50-2.00]." in text
    )
    assert "Traced alike (the programs' digests equal): yes." in text
    rounds[1] = (rounds[1][0], _side([1.0], traced={"none": 1.0, "layer": 1.0}, trace_digest="456"))
    text = plan_time.report(rounds, "def456 new", "abc123 old", "small", ARGV)
    assert "Traced alike (the programs' digests equal): no (2 digests)." in text


def test_the_state_bound_table_gives_each_rounds_ratio_and_whether_bytes_agree():
    def side(seconds, digest="aaa"):
        return {
            **_side([1.0]),
            "state_seconds": seconds,
            "state_digest": digest,
            "state_configs": 2163,
        }

    rounds = [(side(30.0), side(60.0)), (side(32.0), side(56.0))]
    text = plan_time.report(rounds, "def456 new", "abc123 old", "small", ARGV, "qwen2-57b-a14b")
    assert "`qwen2-57b-a14b`'s 2163 layouts and ZeRO stages" in text
    assert "| 1 | 30.0 | 60.0 | 2.00 |" in text
    assert "| 2 | 32.0 | 56.0 | 1.75 |" in text
    assert "other / this 1.88 [1.75-2.00]" in text
    assert "Bounded alike (the bytes' digests equal): yes." in text
    rounds[1] = (side(32.0), side(56.0, digest="bbb"))
    text = plan_time.report(rounds, "def456 new", "abc123 old", "small", ARGV, "qwen2-57b-a14b")
    assert "Bounded alike (the bytes' digests equal): no (2 digests)." in text
