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


def test_each_form_builds_the_model_afresh():
    """The planner's model structure is kept per model (jaxmoe/layers/shapes.py): each form
    clears it, so that its norms are the form's."""
    from flax import nnx

    from jaxmoe.config import ModelConfig
    from jaxmoe.train import state

    model = ModelConfig(norm="rmsnorm")
    made = lambda: type(norms.make_norm(model, 8, dtype="float32", rngs=nnx.Rngs(0)))
    with input_kept_memory.kept_as("activations"):
        assert made() is nnx.RMSNorm
        assert state.abstract_model.cache_info().currsize == 0
    with input_kept_memory.kept_as("activations and norms"):
        assert made() is norms.InputKeptRMSNorm
