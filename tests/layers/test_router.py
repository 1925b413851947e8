"""Router: top-k choice, auxiliary losses, score functions and jitter, against hand-checked values.

Every expected number is written out by hand or computed with plain numpy in the
test, never with the function under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmoe.layers.router import (
    Router,
    balance_loss,
    load_balancing_loss,
    router_scores,
    router_z_loss,
    select_experts,
    top_k_experts,
    update_expert_bias,
)

# Three tokens, three experts. Token 2 ties experts 0 and 1.
SCORES = np.array(
    [
        [0.1, 0.6, 0.3],
        [0.5, 0.2, 0.3],
        [0.4, 0.4, 0.2],
    ],
    dtype=np.float32,
)


def ranked_by_themselves(scores):
    """Scores as their own logits: any increasing function of the logits ranks alike."""
    return jnp.asarray(scores), jnp.asarray(scores)


@pytest.mark.parametrize("normalize", [True, False])
def test_top_1_keeps_the_raw_score_and_breaks_ties_to_the_lower_expert(normalize):
    weights, index = top_k_experts(*ranked_by_themselves(SCORES), top_k=1, normalize=normalize)

    assert index.dtype == jnp.int32
    np.testing.assert_array_equal(index, [[1], [0], [0]])
    np.testing.assert_allclose(weights, [[0.6], [0.5], [0.4]], rtol=0, atol=1e-7)


def test_top_2_normalised_weights_sum_to_one():
    weights, index = top_k_experts(*ranked_by_themselves(SCORES), top_k=2, normalize=True)

    np.testing.assert_array_equal(index, [[1, 2], [0, 2], [0, 1]])
    expected = [[0.6 / 0.9, 0.3 / 0.9], [0.5 / 0.8, 0.3 / 0.8], [0.5, 0.5]]
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    np.testing.assert_allclose(np.sum(weights, axis=-1), 1.0, rtol=1e-6)


def test_top_2_without_normalisation_keeps_raw_scores():
    weights, index = top_k_experts(*ranked_by_themselves(SCORES), top_k=2, normalize=False)

    np.testing.assert_array_equal(index, [[1, 2], [0, 2], [0, 1]])
    np.testing.assert_allclose(weights, [[0.6, 0.3], [0.5, 0.3], [0.4, 0.4]], atol=1e-7)


def test_top_k_works_on_grouped_scores():
    grouped = jnp.asarray(np.stack([SCORES, SCORES[::-1]]))  # [groups=2, tokens=3, experts=3]
    weights, index = top_k_experts(grouped, grouped, top_k=1, normalize=True)

    assert index.shape == (2, 3, 1)
    np.testing.assert_array_equal(index[..., 0], [[1, 0, 0], [0, 0, 1]])
    np.testing.assert_allclose(weights[..., 0], [[0.6, 0.5, 0.4], [0.4, 0.5, 0.6]], atol=1e-7)


def test_top_k_ranks_by_logits_and_weights_by_scores():
    # Scores in the opposite order to the logits: the logits choose, the scores weigh.
    logits = jnp.array([[1.0, 3.0, 2.0]])
    scores = jnp.array([[0.9, 0.1, 0.5]])

    weights, index = top_k_experts(logits, scores, top_k=2, normalize=False)

    np.testing.assert_array_equal(index, [[1, 2]])
    np.testing.assert_array_equal(weights, np.array([[0.1, 0.5]], np.float32))


def test_sigmoid_router_follows_logits_where_the_float32_scores_saturate():
    # Above a logit of about 17 the float32 sigmoid is exactly 1.0 for every expert;
    # ranking by those scores would tie them all and choose experts 0 and 1.
    logits = np.array([[[20.0, 25.0, 40.0, 30.0]]], np.float32)
    router = make_router(top_k=2, score_function="sigmoid")
    router.kernel[...] = jnp.eye(D_MODEL, NUM_EXPERTS, dtype=jnp.float32)
    x = jnp.asarray(np.pad(logits, ((0, 0), (0, 0), (0, D_MODEL - NUM_EXPERTS))))
    assert np.all(np.asarray(jax.nn.sigmoid(logits)) == 1.0)  # the scores do tie

    out = router(x)

    np.testing.assert_array_equal(out.expert_index, [[[2, 3]]])
    np.testing.assert_array_equal(out.combine_weight, [[[0.5, 0.5]]])  # sigmoids of 1.0, normalised


def test_load_balancing_loss_is_one_for_uniform_routing():
    num_experts = 4
    scores = jnp.full((1, 4, num_experts), 0.25)
    expert_index = jnp.array([[[0], [1], [2], [3]]])

    loss = load_balancing_loss(scores, expert_index, num_experts)

    assert float(loss) == 1.0


def test_load_balancing_loss_for_all_tokens_on_one_expert():
    # Every token picks expert 0 with probability p: f = (1, 0, 0, 0), P = (p, ...), loss = E * p.
    num_experts, p = 4, 0.7
    row = [p] + [(1 - p) / (num_experts - 1)] * (num_experts - 1)
    scores = jnp.asarray(np.tile(row, (1, 5, 1)), jnp.float32)
    expert_index = jnp.zeros((1, 5, 1), jnp.int32)

    loss = load_balancing_loss(scores, expert_index, num_experts)

    np.testing.assert_allclose(loss, num_experts * p, rtol=1e-6)


def test_load_balancing_loss_averages_over_groups():
    num_experts, p = 4, 0.7
    uniform = np.full((4, num_experts), 0.25)
    concentrated = np.tile([p] + [(1 - p) / 3] * 3, (4, 1))
    scores = jnp.asarray(np.stack([uniform, concentrated]), jnp.float32)
    expert_index = jnp.array([[[0], [1], [2], [3]], [[0], [0], [0], [0]]])

    loss = load_balancing_loss(scores, expert_index, num_experts)

    np.testing.assert_allclose(loss, (1.0 + num_experts * p) / 2, rtol=1e-6)


def test_load_balancing_loss_with_top_2_counts_fractions_of_assignments():
    scores = np.array([[0.5, 0.3, 0.1, 0.1], [0.2, 0.2, 0.4, 0.2]], np.float32)
    expert_index = np.array([[0, 1], [2, 0]])
    # f_e: assignments to e over all 4 assignments; P_e: mean score of e.
    fraction = np.bincount(expert_index.ravel(), minlength=4) / expert_index.size
    mean_probability = scores.mean(axis=0)
    expected = 4 * np.sum(fraction * mean_probability)

    loss = load_balancing_loss(jnp.asarray(scores[None]), jnp.asarray(expert_index[None]), 4)

    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(expected, 4 * (0.5 * 0.35 + 0.25 * 0.25 + 0.25 * 0.25))


def test_load_balancing_loss_normalises_unnormalised_scores():
    # Sigmoid scores need not sum to one; they are normalised per token first.
    scores = jnp.full((1, 4, 4), 0.5)
    expert_index = jnp.array([[[0], [1], [2], [3]]])

    loss = load_balancing_loss(scores, expert_index, 4)

    np.testing.assert_allclose(loss, 1.0, rtol=1e-6)


def test_router_z_loss_is_mean_squared_logsumexp():
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [-1.0, 4.0, 0.5]], np.float32)
    logsumexp = np.log(np.sum(np.exp(logits.astype(np.float64)), axis=-1))
    expected = np.mean(logsumexp**2)
    # Token 1 by hand: log(3)^2.
    np.testing.assert_allclose(logsumexp[1] ** 2, np.log(3.0) ** 2)

    np.testing.assert_allclose(router_z_loss(jnp.asarray(logits)), expected, rtol=1e-6)


def test_router_scores_softmax_and_sigmoid():
    logits = np.array([[0.0, 1.0, -2.0, 0.5]], np.float32)
    exp = np.exp(logits.astype(np.float64))

    softmax = router_scores(jnp.asarray(logits), "softmax")
    sigmoid = router_scores(jnp.asarray(logits), "sigmoid")

    np.testing.assert_allclose(softmax, exp / exp.sum(axis=-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(np.sum(softmax), 1.0, rtol=1e-6)
    np.testing.assert_allclose(sigmoid, 1 / (1 + np.exp(-logits.astype(np.float64))), rtol=1e-6)
    np.testing.assert_allclose(sigmoid[0, 0], 0.5)
    assert not np.isclose(np.sum(sigmoid), 1.0)


def test_router_scores_rejects_unknown_function():
    with pytest.raises(ValueError, match="unknown score function"):
        router_scores(jnp.zeros((1, 2)), "relu")


# --- The Router module -----------------------------------------------------------------------

D_MODEL, NUM_EXPERTS = 6, 4


def make_router(jitter=0.0, top_k=2, score_function="softmax"):
    return Router(
        D_MODEL,
        NUM_EXPERTS,
        top_k=top_k,
        score_function=score_function,
        jitter=jitter,
        rngs=nnx.Rngs(0),
    )


def router_input():
    return jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, D_MODEL)), jnp.float32)


def assert_outputs_equal(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_router_matches_numpy_on_its_own_kernel():
    router = make_router(top_k=2)
    x = np.asarray(router_input(), np.float64)
    kernel = np.asarray(router.kernel[...], np.float64)
    logits = x @ kernel
    scores = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    index = np.argsort(-scores, axis=-1, kind="stable")[..., :2]
    weights = np.take_along_axis(scores, index, axis=-1)
    weights = weights / weights.sum(-1, keepdims=True)

    out = router(jnp.asarray(x, jnp.float32))

    np.testing.assert_array_equal(out.expert_index, index)
    np.testing.assert_allclose(out.combine_weight, weights, rtol=1e-5)
    np.testing.assert_allclose(out.z_loss, np.mean(np.log(np.exp(logits).sum(-1)) ** 2), rtol=1e-5)


def test_router_without_jitter_ignores_the_key():
    router = make_router(jitter=0.0)
    x = router_input()

    assert_outputs_equal(router(x), router(x, jax.random.key(7)))


def test_router_with_jitter_but_no_key_is_deterministic_and_noise_free():
    x = router_input()
    noisy = make_router(jitter=0.5)
    clean = make_router(jitter=0.0)

    assert_outputs_equal(noisy(x), clean(x))


def test_router_jitter_changes_logits_and_is_deterministic_per_key():
    router = make_router(jitter=0.5)
    x = router_input()
    clean = router(x)

    first = router(x, jax.random.key(11))
    again = router(x, jax.random.key(11))
    other = router(x, jax.random.key(12))

    assert_outputs_equal(first, again)
    # The z-loss and the scores are functions of the logits: both move with the noise.
    assert float(first.z_loss) != float(clean.z_loss)
    assert not np.allclose(first.combine_weight, clean.combine_weight)
    assert not np.allclose(first.combine_weight, other.combine_weight)


def test_router_jitter_is_multiplicative_input_noise_in_range():
    # Noise is U(1 - jitter, 1 + jitter) on the input: logits stay within that band per input.
    jitter = 0.1
    router = make_router(jitter=jitter)
    x = jnp.ones((1, 3, D_MODEL))  # positive input, so x * noise lies in [1 - j, 1 + j]
    kernel = np.abs(np.asarray(router.kernel[...], np.float64))
    router.kernel[...] = jnp.asarray(kernel, jnp.float32)  # positive kernel: logits are monotone
    logits_low = (1 - jitter) * kernel.sum(0)
    logits_high = (1 + jitter) * kernel.sum(0)
    low = np.log(np.exp(logits_low).sum())
    high = np.log(np.exp(logits_high).sum())

    out = router(x, jax.random.key(5))

    assert low**2 - 1e-5 <= float(out.z_loss) <= high**2 + 1e-5


def test_router_jitter_scales_the_input_so_a_zero_input_stays_zero():
    router = make_router(jitter=0.5)
    x = jnp.zeros((1, 3, D_MODEL))

    assert_outputs_equal(router(x, jax.random.key(5)), router(x))


# --- The routing families against Hugging Face's routers, on fixed logits ----------------------
#
# The references below restate, in numpy, what Hugging Face's MixtralSparseMoeBlock,
# Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock (norm_topk_prob) and DeepseekV3TopkRouter
# compute. torch.topk leaves the order of ties unspecified; the references break them to
# the lower index (a stable sort), as the router does.

EXPERTS = 8
FIXED_LOGITS = np.array(
    [
        [0.3, -1.2, 1.7, 0.4, -0.6, 1.1, 0.0, -0.2],
        [1.5, 1.5, -0.3, 0.9, 0.2, -1.0, 0.9, 0.4],  # ties: experts 0 and 1, 3 and 6
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # every expert ties
        [-0.5, 0.8, 0.8, -1.5, 1.9, 0.1, -0.4, 1.2],
        [1.0, 0.2, 0.9, 1.3, -0.7, 1.3, 0.5, 0.6],  # ties: experts 3 and 5
    ],
    np.float32,
)
BIAS = np.array([0.1, -0.05, 0.0, 0.2, -0.1, 0.0, 0.05, 0.3], np.float32)


def stable_top(values, k):
    """Indices of the k largest values per row, ties to the lower index."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def hf_softmax_router(logits, top_k, norm_topk_prob):
    """Mixtral (always renormalises) and Qwen2/3-MoE (``norm_topk_prob``)."""
    logits = logits.astype(np.float64)
    probabilities = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    index = stable_top(probabilities, top_k)
    weights = np.take_along_axis(probabilities, index, -1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return index, weights


def hf_deepseek_v3_router(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """DeepseekV3TopkRouter: sigmoid scores, selection by scores + bias within the best
    groups (each scored by its two best biased scores), weights the unbiased scores."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias
    per_group = EXPERTS // n_group
    grouped = choice.reshape(len(choice), n_group, per_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    group_mask = np.zeros((len(choice), n_group), bool)
    np.put_along_axis(group_mask, stable_top(group_scores, topk_group), True, -1)
    masked = np.where(np.repeat(group_mask, per_group, -1), choice, 0.0)  # HF fills with 0.0
    index = stable_top(masked, top_k)
    weights = np.take_along_axis(scores, index, -1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return index, weights * scaling


def router_on_logits(logits, bias=None, **options):
    """The Router with an identity kernel, so its logits are its input ``[tokens, E]``."""
    router = Router(EXPERTS, EXPERTS, expert_bias=bias is not None, rngs=nnx.Rngs(0), **options)
    router.kernel[...] = jnp.eye(EXPERTS, dtype=jnp.float32)
    if bias is not None:
        router.expert_bias[...] = jnp.asarray(bias)
    out = router(jnp.asarray(logits)[None])
    return np.asarray(out.expert_index[0]), np.asarray(out.combine_weight[0])


@pytest.mark.parametrize(
    ("family", "top_k", "normalize"),
    [("mixtral", 2, True), ("qwen2-moe", 4, False), ("qwen3-moe", 4, True)],
)
def test_softmax_routing_matches_hugging_face(family, top_k, normalize):
    expected_index, expected_weights = hf_softmax_router(FIXED_LOGITS, top_k, normalize)

    index, weights = router_on_logits(FIXED_LOGITS, top_k=top_k, normalize_top_k=normalize)

    np.testing.assert_array_equal(index, expected_index, err_msg=family)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-6, err_msg=family)
    np.testing.assert_array_equal(index[1, :2], [0, 1])  # the tie goes to the lower index
    np.testing.assert_array_equal(index[2], np.arange(top_k))


DEEPSEEK = dict(score_function="sigmoid", normalize_top_k=True, routed_scaling_factor=2.5)


@pytest.mark.parametrize(
    ("groups", "top_groups", "top_k"),
    [(1, None, 3), (4, 2, 3), (4, 1, 2), (2, 1, 4)],
    ids=["no-groups", "4-groups-keep-2", "4-groups-keep-1", "2-groups-keep-1"],
)
def test_deepseek_v3_routing_matches_hugging_face(groups, top_groups, top_k):
    expected_index, expected_weights = hf_deepseek_v3_router(
        FIXED_LOGITS, BIAS, top_k, groups, top_groups or groups, True, 2.5
    )

    index, weights = router_on_logits(
        FIXED_LOGITS,
        BIAS,
        top_k=top_k,
        num_expert_groups=groups,
        top_k_expert_groups=top_groups,
        **DEEPSEEK,
    )

    np.testing.assert_array_equal(index, expected_index)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-6)
    np.testing.assert_allclose(weights.sum(-1), 2.5, rtol=1e-6)


def test_the_bias_chooses_the_experts_but_does_not_weigh_them():
    logits = FIXED_LOGITS[:1]  # expert 2 (1.7), then 5 (1.1), 3 (0.4), 0 (0.3)
    bias = np.zeros(EXPERTS, np.float32)
    bias[0] = 1.0  # lifts expert 0 past all the others

    plain, plain_weights = router_on_logits(logits, np.zeros(EXPERTS), top_k=2, **DEEPSEEK)
    biased, biased_weights = router_on_logits(logits, bias, top_k=2, **DEEPSEEK)

    np.testing.assert_array_equal(plain, [[2, 5]])
    np.testing.assert_array_equal(biased, [[0, 2]])
    sigmoid = 1 / (1 + np.exp(-logits[0, [0, 2]].astype(np.float64)))
    np.testing.assert_allclose(biased_weights[0], 2.5 * sigmoid / sigmoid.sum(), rtol=1e-6)
    assert not np.allclose(plain_weights, biased_weights)


def test_tied_groups_go_to_the_lower_group_and_only_their_experts_are_chosen():
    # Groups of two. Groups 0 (experts 0, 1) and 1 (experts 2, 3) tie exactly at
    # sigmoid(1.0) + sigmoid(0.5) = 1.353; group 2 scores sigmoid(1.2) + sigmoid(0) = 1.269.
    logits = np.array([[1.0, 0.5, 0.5, 1.0, 1.2, 0.0, -3.0, -3.0]], np.float32)
    options = dict(top_k=2, num_expert_groups=4, score_function="sigmoid")

    one_group, _ = router_on_logits(logits, top_k_expert_groups=1, **options)
    two_groups, _ = router_on_logits(logits, top_k_expert_groups=2, **options)
    ungrouped, _ = router_on_logits(logits, top_k=2, score_function="sigmoid")

    np.testing.assert_array_equal(one_group, [[0, 1]])  # the tie goes to group 0
    np.testing.assert_array_equal(two_groups, [[0, 3]])  # experts 0 and 3 tie at 1.0
    np.testing.assert_array_equal(ungrouped, [[4, 0]])  # expert 4 is the best on its own


def test_a_masked_group_is_never_chosen_even_below_zero():
    # Every eligible biased score is negative; Hugging Face fills the masked ones with 0.0
    # and would pick them, the router fills them with -inf.
    logits = np.full((1, EXPERTS), -4.0, np.float32)
    logits[0, :2] = 0.0  # group 0 (experts 0, 1) is the best group
    bias = np.full(EXPERTS, -0.6, np.float32)

    index, _ = router_on_logits(
        logits, bias, top_k=2, num_expert_groups=4, top_k_expert_groups=1, **DEEPSEEK
    )

    np.testing.assert_array_equal(index, [[0, 1]])


def test_routed_scaling_factor_scales_the_softmax_weights_too():
    index, weights = router_on_logits(FIXED_LOGITS, top_k=2, routed_scaling_factor=2.0)
    _, expected = hf_softmax_router(FIXED_LOGITS, 2, True)

    np.testing.assert_array_equal(index, hf_softmax_router(FIXED_LOGITS, 2, True)[0])
    np.testing.assert_allclose(weights, 2.0 * expected, rtol=1e-6)


def test_select_experts_with_groups_but_no_limit_is_plain_top_k():
    logits = jnp.asarray(FIXED_LOGITS)
    scores = jax.nn.sigmoid(logits)

    limited = select_experts(logits, scores, 3, num_groups=4, top_k_groups=4)

    np.testing.assert_array_equal(limited, select_experts(logits, scores, 3))


def test_update_expert_bias_moves_against_the_load():
    bias = jnp.array([0.0, 0.5, -0.5, 0.0])
    load = jnp.array([10, 2, 4, 4])  # mean 5: expert 0 over, the others under

    updated = update_expert_bias(bias, load, 0.01)

    np.testing.assert_array_equal(updated, np.float32([0.0 - 0.01, 0.51, -0.49, 0.01]))
    np.testing.assert_array_equal(update_expert_bias(bias, jnp.array([3, 3, 3, 3]), 0.01), bias)


def test_balance_loss_of_partial_sums_adds_up_to_the_whole_group():
    rng = np.random.default_rng(0)
    probabilities = rng.dirichlet(np.ones(4), size=6).astype(np.float32)  # 6 tokens
    counts = jnp.array([5, 4, 2, 1])  # the whole group's, top-2

    whole = balance_loss(counts, probabilities.sum(0), tokens=6, top_k=2)
    halves = sum(
        balance_loss(counts, part.sum(0), tokens=6, top_k=2) for part in np.split(probabilities, 2)
    )

    np.testing.assert_allclose(halves, whole, rtol=1e-6)
    expected = 4 * np.sum(np.array([5, 4, 2, 1]) / 12 * probabilities.mean(0))
    np.testing.assert_allclose(whole, expected, rtol=1e-6)
