"""experiments/activation_memory.py: its two forms of the activations, compared alike."""

from __future__ import annotations

from experiments import activation_memory
from jaxmoe.layers import activations


def test_the_forms_differ_in_what_they_keep_and_the_switch_is_undone():
    sizes = {}
    for form in activation_memory.FORMS:
        with activation_memory.activations_as(form):
            sizes[form] = activation_memory.stack_temporaries(2, 256, 16, 64)
    assert sizes["input kept"] < sizes["as written"]
    assert activations._INPUT_KEPT["swiglu"] is activations.swiglu
