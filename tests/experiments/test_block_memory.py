"""The block-memory breakdown (experiments/block_memory.py): its results file gives each
case's total per token and its largest groups with their shares, the rest summed."""

from experiments import block_memory


def test_each_case_gives_its_total_a_token_and_its_largest_groups(monkeypatch):
    monkeypatch.setattr(block_memory, "ROWS", 2)
    groups = [
        (("dot_general", "moe/esd,edth->esth", "bfloat16", (1, 8192, 2, 16384)), 600e6),
        (("mul", "moe/activation", "bfloat16", (1, 8192, 16384)), 300e6),
        (("add", "(the block)", "bfloat16", (1, 2048, 6144)), 50e6),
        (("exp", "moe", "float32", (1, 2048, 8)), 50e6),
    ]
    kept = {
        "label": "attention 64x2",
        "tokens": 2048,
        "groups": groups,
        "block": 1e9,
        "all": 2e9,
        "parameters": 6e8,
    }
    text = block_memory.render([("Megatron-Core's layout", "mixtral-8x22b", kept)], [])
    assert "## mixtral-8x22b, Megatron-Core's layout: attention 64x2" in text
    assert "1000.0 MB of activations in the block, for the 2048 tokens" in text
    assert "488.3 kB a token; beside them 600.0 MB of the block's weights" in text
    assert (
        "| 600.0 | 60% | `dot_general` | moe/esd,edth->esth | bfloat16 | [1, 8192, 2, 16384] |"
        in text
    )
    assert "| 100.0 | 10% | 2 more | | | |" in text
    assert "`add`" not in text
