"""Cached decoding against the forward pass over the whole sequence, for the GPT-2 family
and the Llama-derived ones (GQA, rotary positions, query/key norms) and DeepSeek-V3's
(multi-head latent attention: the latent cache, the up-projections absorbed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.config import ConfigError
from jaxmoe.generate import Decoder, Sampling
from jaxmoe.generate import decoder as decoder_module

from .models import FAMILIES, SEQ_LEN, full_logits, small_model


def _tokens(name: str, batch: int, length: int, seed: int = 0) -> np.ndarray:
    vocab = small_model(name).config.vocab_size
    return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int32)


# The other families' cached decoding (grouped-query and latent attention, rotary positions,
# query/key norms, a head width of their own) is checked by default against transformers'
# logits in tests/generate/test_hf_fixtures.py, from the prefill on, one position at a
# time: here they are slow.
@pytest.mark.parametrize(
    "name",
    [name if name == "tiny" else pytest.param(name, marks=pytest.mark.slow)
     for name in FAMILIES],
)  # fmt: skip
def test_cached_decoding_gives_the_logits_of_the_full_forward_pass(name):
    model = small_model(name)
    tokens = _tokens(name, batch=2, length=12)
    decoder = Decoder(model)
    cache = decoder.init_cache(2, 12)
    logits, cache = decoder.forward(tokens[:, :5], cache, 0)  # the prefill
    steps = [logits]
    for position in range(5, 12):
        logits, cache = decoder.forward(tokens[:, position : position + 1], cache, position)
        steps.append(logits)
    cached = np.concatenate([np.asarray(step) for step in steps], axis=1)
    np.testing.assert_allclose(cached, full_logits(model, tokens), rtol=1e-5, atol=1e-5)


# The generation loop is the same for every family (each family's decoding is checked
# above): the other families are slow.
@pytest.mark.parametrize(
    "name",
    [name if name == "tiny" else pytest.param(name, marks=pytest.mark.slow)
     for name in FAMILIES],
)  # fmt: skip
def test_greedy_generation_is_the_argmax_of_repeated_full_forward_passes(name):
    model = small_model(name)
    prompt = _tokens(name, batch=2, length=4, seed=1)
    generated = Decoder(model).generate(prompt, 6)

    # Full passes over a fixed-length buffer (one compilation): position i sees 0..i only.
    rows = np.zeros((2, SEQ_LEN), np.int32)
    rows[:, :4] = prompt
    for position in range(4, 10):
        logits = full_logits(model, rows)
        rows[:, position] = np.argmax(np.asarray(logits)[:, position - 1], axis=-1)
    assert generated == rows[:, 4:10].tolist()


def test_generation_stops_at_a_stop_id_and_at_the_last_position():
    # The greedy test's model and prompt shape: the same prefill and step programs.
    decoder = Decoder(small_model("tiny"))
    prompt = _tokens("tiny", batch=2, length=4, seed=1)
    whole = decoder.generate(prompt, 6)
    stop = whole[0][2]
    stopped = decoder.generate(prompt, 6, stop_ids=[stop])
    for row, continuation in zip(whole, stopped, strict=True):
        expected = row[: row.index(stop)] if stop in row else row
        assert continuation == expected
    # Sequences end at model.seq_len positions.
    long_prompt = _tokens("tiny", batch=1, length=SEQ_LEN - 2)
    assert len(decoder.generate(long_prompt, 10)[0]) == 2
    assert decoder.generate(_tokens("tiny", 1, SEQ_LEN), 10) == [[]]
    with pytest.raises(ValueError, match=r"model\.seq_len is 16"):
        decoder.generate(_tokens("tiny", 1, SEQ_LEN + 1), 1)


def test_learned_positions_bound_the_cache():
    model = small_model("tiny")
    with pytest.raises(ValueError, match=r"learned positions stop at model\.seq_len=16"):
        model.init_cache(1, SEQ_LEN + 1)


def test_each_decoding_step_after_the_prefill_reuses_one_compilation():
    decoder = Decoder(small_model("qwen3_moe-tiny"))
    prompt = _tokens("qwen3_moe-tiny", batch=1, length=3, seed=2)
    sampling = Sampling(temperature=0.7)
    before = decoder_module._next_token._cache_size()
    first = decoder.generate(prompt, 5, sampling, seed=1)
    assert decoder_module._next_token._cache_size() - before <= 2  # the prefill, one step
    compiled = decoder_module._next_token._cache_size()
    # Neither the seed nor the settings compile again.
    again = decoder.generate(prompt, 5, sampling, seed=1)
    other = [decoder.generate(prompt, 5, sampling, seed=seed)[0] for seed in range(2, 6)]
    decoder.generate(prompt, 5, Sampling(temperature=1.2, top_k=3, top_p=0.9), seed=1)
    decoder.generate(prompt, 5)
    assert decoder_module._next_token._cache_size() == compiled
    assert again == first  # a seed draws the same tokens
    assert any(row != first[0] for row in other)


def test_sampling_from_the_single_likeliest_token_is_greedy():
    decoder = Decoder(small_model("tiny"))
    # The greedy test's prompt shape and length: its programs (the settings are traced).
    prompt = _tokens("tiny", batch=2, length=4, seed=3)
    greedy = decoder.generate(prompt, 6)
    assert decoder.generate(prompt, 6, Sampling(temperature=1.5, top_k=1), seed=4) == greedy
    assert decoder.generate(prompt, 6, Sampling(temperature=1.5, top_p=1e-6), seed=4) == greedy


def test_sampling_draws_only_what_the_filters_keep():
    from jaxmoe.generate.sampling import choose_next, filtered_logits

    logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.15, 0.25]]))

    def kept(sampling):
        filtered = filtered_logits(logits, *sampling.arrays())
        return set(np.flatnonzero(np.isfinite(filtered[0])).tolist())

    assert kept(Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert kept(Sampling(temperature=1.0, top_k=2)) == {1, 3}
    assert kept(Sampling(temperature=1.0, top_k=9)) == {0, 1, 2, 3}
    assert kept(Sampling(temperature=1.0, top_p=0.7)) == {1, 3}  # 0.5 < 0.7 <= 0.75
    assert kept(Sampling(temperature=1.0, top_p=0.5)) == {1}
    assert kept(Sampling(temperature=2.0, top_k=3, top_p=0.99)) == {1, 2, 3}
    assert kept(Sampling(temperature=1.0, top_k=3, top_p=0.6)) == {1, 3}
    keys = jax.random.split(jax.random.key(0), 400)
    top_two = Sampling(temperature=1.0, top_k=2).arrays()
    draw = jax.vmap(lambda key: choose_next(logits, key, *top_two))
    assert set(np.asarray(draw(keys)).ravel().tolist()) == {1, 3}
    assert np.asarray(choose_next(logits, keys[0], *Sampling().arrays())).tolist() == [1]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -1.0}, "--temperature -1.0: must be >= 0"),
        ({"temperature": float("nan")}, "--temperature nan: must be a number"),
        ({"top_k": -2}, "--top-k -2: must be an integer >= 0"),
        ({"top_p": 0.0}, "--top-p 0.0: must be in (0, 1]"),
        ({"top_p": 1.5}, "--top-p 1.5: must be in (0, 1]"),
    ],
)
def test_bad_sampling_values_are_refused(fields, message):
    with pytest.raises(ConfigError) as error:
        Sampling(**fields)
    assert message in str(error.value)
