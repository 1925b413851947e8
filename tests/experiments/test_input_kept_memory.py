"""experiments/input_kept_memory.py: its forms of the activations and norms, compared alike."""

from __future__ import annotations

from experiments import input_kept_memory
from jaxmoe.layers import activations, input_kept, norms


def test_the_forms_differ_in_what_they_keep_and_the_switch_is_undone():
    swiglu, normed = {}, {}
    for form in input_kept_memory.FORMS:
        with input_kept_memory.kept_as(form):
            swiglu[form] = input_kept_memory.swiglu_temporaries(2, 256, 16, 64)
            normed[form] = input_kept_memory.norm_temporaries(2, 512, 32)
    assert swiglu["activations"] < swiglu["as written"]
    assert normed["activations and norms"] < normed["activations"] == normed["as written"]
    assert activations.kept_inputs is norms.kept_inputs is input_kept.kept_inputs
