"""The folding evaluation's comparison, ordering and tables, on a tiny model."""

import dataclasses
from types import SimpleNamespace

import pytest

from experiments import folding_eval, folding_models
from jaxmoe.plan.mappings import Mapping, enumerate_mappings
from tests.train.runs import small_config

MEMORY = folding_eval.DeviceMemory(argument=100, output=100, temp=50, alias=90)


def run(label, losses, dropped):
    return folding_eval.LayoutRun(label, tuple(losses), tuple(dropped), MEMORY, 0.0)


def test_compare_reports_relative_loss_difference_and_unequal_drops():
    reference = run("ref", [2.0, 1.0], [0.1, 0.2])
    close = folding_eval.compare(reference, run("close", [2.0, 1.000001], [0.1, 0.2]))
    assert close.relative_loss_diff == pytest.approx((0.0, 1e-6))
    assert close.dropped_equal and close.within_tolerance
    other_drop = folding_eval.compare(reference, run("drop", [2.0, 1.0], [0.1, 0.25]))
    assert not other_drop.dropped_equal and not other_drop.within_tolerance
    far = folding_eval.compare(reference, run("far", [2.002, 1.0], [0.1, 0.2]))
    assert far.max_relative_loss_diff == pytest.approx(1e-3) and not far.within_tolerance
    with pytest.raises(ValueError, match="steps"):
        folding_eval.compare(reference, run("short", [2.0], [0.1]))
    assert MEMORY.peak == 250


def tiny_config(group_size=16):
    config = small_config()
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, group_size=group_size))


def test_layouts_start_with_the_reference_and_alternate_tensor_sizes():
    config = tiny_config()
    ordered = folding_eval.ordered_layouts(config)
    valid = enumerate_mappings(config, 8).valid
    assert sorted(c.mapping.label() for c in ordered) == sorted(c.mapping.label() for c in valid)
    assert ordered[0].mapping.label() == folding_eval.REFERENCE
    tensors = sorted({c.mapping.tensor for c in valid})
    assert [c.mapping.tensor for c in ordered[1 : 1 + len(tensors)]] == tensors


@pytest.mark.slow  # the folded layouts' training is tests/train/test_tensor_parallel.py's
def test_two_folded_layouts_train_as_the_reference():
    """The reference, tensor 2 with the expert group across the tensor axis, and expert
    tensor 2 with the all_gather dispatcher: 2 steps each."""
    config = tiny_config()
    wanted = (
        folding_eval.REFERENCE,
        "attention 4x2, MoE 1x8x1, all_to_all",
        "attention 8x1, MoE 1x4x2, all_gather",
    )
    by_label = {c.mapping.label(): c for c in folding_eval.ordered_layouts(config)}
    written = []
    comparisons = folding_eval.evaluate(
        config, [by_label[label] for label in wanted], steps=2, on_result=written.append
    )
    assert [c.label for c in comparisons] == list(wanted) and len(written) == 3
    assert all(d > 0 for d in comparisons[0].dropped), "capacity must force drops"
    for comparison in comparisons:
        assert comparison.within_tolerance, comparison
        assert comparison.memory.peak > 0
    text = folding_eval.report(comparisons, total=40, steps=2, command="cmd")
    assert "Ran 3 of the 40 valid layouts" in text and "3 of 3" in text
    assert all(f"| {label} |" in text for label in wanted)


def estimate(tensor, expert_tensor, step, devices=64):
    mapping = Mapping(devices, tensor, devices // (8 * expert_tensor), 8, expert_tensor, "x")
    return SimpleNamespace(
        mapping=mapping,
        best=SimpleNamespace(step=step),
        mfu=1.0 / step,
        memory=SimpleNamespace(total=1e9),
    )


def test_folding_comparison_picks_the_best_reusing_mapping():
    folded = estimate(tensor=2, expert_tensor=1, step=1.0)
    reused = estimate(tensor=4, expert_tensor=4, step=1.5)
    ranked = [folded, estimate(tensor=2, expert_tensor=4, step=1.2), reused]
    assert [folding_models.reuses_attention_layout(e.mapping) for e in ranked] == [
        False,
        False,
        True,
    ]
    comparison = folding_models.compare_folding("m", ranked)
    assert comparison.best_folded is folded and comparison.best_reused is reused
    assert comparison.speedup == pytest.approx(1.5)
    table = "\n".join(folding_models.comparison_table([comparison]))
    assert "best folded: attention 32x2, MoE 8x8x1" in table
    assert "best reused: attention 16x4, MoE 2x8x4" in table
    empty = folding_models.compare_folding("m", [folded])
    assert empty.best_reused is None and empty.speedup is None


@pytest.mark.parametrize("model", list(folding_models.MODELS))
def test_published_shapes_have_folded_and_reusing_mappings_on_64_devices(model):
    valid = enumerate_mappings(folding_models.planned_config(model, 64), 64).valid
    reusing = [c for c in valid if folding_models.reuses_attention_layout(c.mapping)]
    assert reusing and len(reusing) < len(valid)


def test_scale_report_sets_the_best_folded_against_the_best_reused():
    from experiments import folding_scale

    folded = estimate(tensor=2, expert_tensor=1, step=1.0)
    reused = estimate(tensor=4, expert_tensor=4, step=1.5)
    fitting = folding_models.compare_folding("m", [folded, reused], 64)
    nothing_fits = folding_models.compare_folding("m", [], 64)
    rows = [
        {"model": "m", "devices": 64, "mappings": 2, "fits": 2, "seconds": 3.0,
         "least_memory": 1e9, "least_reused_memory": 2e9, "least_memory_activations": 5e8,
         "fitting": fitting, "all": fitting},
        {"model": "m", "devices": 128, "mappings": 2, "fits": 0, "seconds": 3.0,
         "least_memory": 1e9, "least_reused_memory": 2e9, "least_memory_activations": 5e8,
         "fitting": dataclasses.replace(nothing_fits, devices=128), "all": fitting},
    ]  # fmt: skip
    text = folding_scale.report(rows, "cmd", ["none"], {"recompute": "attention"})
    assert "    cmd" in text and "model.recompute=attention" in text
    assert "- m on 64: best folded step 1.500x faster than best reused" in text
    assert "| m | 128 | best folded: none fits | | | |" in text
    assert "| m | 64 | 2 | 2 | 1.0 | 2.0 | 3 |" in text
    assert "- m on 64: activations are 0.5 of the least-memory mapping's 1.0 GB" in text
    assert "## What the simulator leaves out" in text


def test_scale_refuses_an_unknown_model_before_planning(capsys):
    from experiments import folding_scale

    with pytest.raises(SystemExit):
        folding_scale.main(["--models", "gpt-9"])
    assert "--models: unknown gpt-9" in capsys.readouterr().err
