"""Megatron-Core's recipes as jaxmoe mappings (experiments/published_recipes.py): each one
is a layout jaxmoe accepts, with the recipe's degrees and micro-batches of one sequence."""

import pytest

from experiments.published_recipes import RECIPES, recipe_config
from jaxmoe.plan.mappings import with_mapping


@pytest.mark.parametrize("model", RECIPES)
def test_each_recipe_is_a_mapping_jaxmoe_accepts(model):
    recipe = RECIPES[model]
    mapping = recipe.mapping()
    config = with_mapping(recipe_config(model), mapping, 8)
    parallel = config.parallel
    assert parallel.num_devices == recipe.devices
    assert (parallel.pipeline, parallel.virtual_stages) == (recipe.pipeline, recipe.virtual)
    assert (parallel.tensor, parallel.expert, parallel.expert_tensor) == (
        recipe.tensor, recipe.expert, 1,
    )  # fmt: skip
    assert config.train.zero == 1 and config.moe.dispatcher == "all_to_all"
    # Micro-batches of one sequence per attention data replica.
    assert config.train.batch_size == recipe.global_batch
    assert config.train.batch_size // (recipe.data * config.train.microbatches) == 1
