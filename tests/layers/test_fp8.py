"""FP8 GEMMs (``model.fp8``): what they compute against float32, what their recipes scale,
their gradients, and that the programs they build multiply float8 operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.layers import fp8

RECIPES = fp8.RECIPES
# e4m3 keeps 3 mantissa bits: each operand's values are within 2^-4 of themselves, and a
# product of two such sums of many terms is within a few percent (root-mean-square).
FP8_ERROR = 0.06


def relative(got, expected) -> float:
    return float(jnp.linalg.norm(got - expected) / jnp.linalg.norm(expected))


def operands(*shapes, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(key, shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)
            for key, shape in zip(keys, shapes, strict=True)]  # fmt: skip


def loss_of(product):
    return lambda x, w: jnp.sum(jnp.sin(product(x, w)))


@pytest.mark.parametrize("recipe", RECIPES)
def test_products_and_their_gradients_are_float32_s_within_e4m3(recipe):
    # A contraction of 200 (a partial block of 128) and 96 outputs (a partial block).
    x, w = operands((64, 200), (200, 96))
    exact = lambda x, w: x @ w
    fp8_product = lambda x, w: fp8.matmul(x, w, recipe)
    # One program of the products and their gradients (op by op, each would compile alone).
    both = jax.jit(
        lambda x, w: [(f(x, w), jax.grad(loss_of(f), (0, 1))(x, w)) for f in (fp8_product, exact)]
    )
    (product, got), (expected_product, expected) = both(x, w)

    assert product.dtype == x.dtype
    assert relative(product, expected_product) < FP8_ERROR
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and relative(a, b) < FP8_ERROR

    # The experts' batched GEMM: each expert's weights scaled on their own.
    xe, we = operands((4, 16, 200), (4, 200, 2, 24))
    batched = jax.jit(lambda x, w: fp8.batched_matmul(x, w, recipe))(xe, we)
    assert relative(batched, jnp.einsum("esd,edth->esth", xe, we)) < FP8_ERROR


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_grouped_gemm_and_its_gradients_follow_ragged_dot(recipe):
    x, w = operands((64, 200), (4, 200, 96))
    sizes = jnp.array([10, 0, 30, 20], jnp.int32)  # an empty group; 4 rows past them
    exact = lambda x, w: jax.lax.ragged_dot(x, w, sizes)
    grouped = lambda x, w: fp8.grouped_matmul(x, w, sizes, recipe)
    both = jax.jit(
        lambda x, w: [(f(x, w), jax.grad(loss_of(f), (0, 1))(x, w)) for f in (grouped, exact)]
    )
    (product, got), (expected_product, expected) = both(x, w)

    assert relative(product, expected_product) < FP8_ERROR
    assert jnp.all(product[60:] == 0)
    for a, b in zip(got, expected, strict=True):
        assert relative(a, b) < FP8_ERROR
    assert jnp.all(got[1][1] == 0)  # the empty group's weights get no gradient


def test_blockwise_scaling_keeps_small_rows_beside_an_outlier():
    # One row a million times larger: one scale for the operand flushes the others'
    # small values to e4m3's subnormals; a scale per 1 x 128 tile does not.
    x, w = operands((32, 256), (256, 128), seed=1)
    x = x.at[0].multiply(1e6)
    exact = x @ w
    error = {r: relative(fp8.matmul(x, w, r)[1:], exact[1:]) for r in RECIPES}
    assert error["blockwise"] < FP8_ERROR < error["tensorwise"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_gemms_take_float8_operands_and_accumulate_in_float32(recipe):
    x, w = operands((64, 256), (256, 96))
    gradient = jax.grad(loss_of(lambda x, w: fp8.matmul(x, w, recipe)), (0, 1))
    dots = [e for e in _all_eqns(jax.make_jaxpr(gradient)(x, w).jaxpr) if _is_dot(e)]
    assert len(dots) == 3  # forward, input gradient, weight gradient
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.float8_e4m3fn] * 2
        assert eqn.outvars[0].aval.dtype == jnp.float32


def _is_dot(eqn) -> bool:
    return eqn.primitive.name == "dot_general"


def _all_eqns(jaxpr):
    """Every equation, those of the sub-jaxprs in the parameters too."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def test_the_nnx_dot_general_is_one_function_per_recipe():
    assert fp8.dot_general("none") is jax.lax.dot_general
    assert fp8.dot_general("blockwise") is fp8.dot_general("blockwise")
    x, w = operands((8, 32), (32, 16))
    product = fp8.dot_general("tensorwise")(x, w, (((1,), (0,)), ((), ())))
    assert jnp.array_equal(product, fp8.matmul(x, w, "tensorwise"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recomputing_all_but_the_matmuls_keeps_the_fp8_products(recipe, capsys):
    from jaxmoe.layers.recompute import _keeps_matmuls

    x, w = operands((64, 256), (256, 96))
    block = jax.checkpoint(loss_of(lambda x, w: fp8.matmul(x, w, recipe)), policy=_keeps_matmuls)
    jax.ad_checkpoint.print_saved_residuals(block, x, w)
    saved = capsys.readouterr().out
    assert f"f32[64,96] named '{fp8.PRODUCT}'" in saved, saved
