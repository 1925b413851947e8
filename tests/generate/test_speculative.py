"""Speculative decoding drafted by multi-token prediction (jaxmoe/generate/speculative.py):
the tokens of plain greedy decoding, and the drafts counted as the model verifies them,
with the module's drafts and with drafts that are always right or always wrong."""

import numpy as np
import pytest

from jaxmoe.generate import Decoder
from jaxmoe.generate import speculative as speculative_module
from jaxmoe.generate.speculative import speculate

from .models import SEQ_LEN, small_model

NAME = "deepseek_v3-tiny"  # latent attention and one multi-token prediction module
NEW = 10


def _prompt(seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, 4)]


def _plain(prompt: list[int], new: int = NEW) -> list[int]:
    return Decoder(small_model(NAME)).generate([prompt], new)[0]


def test_the_tokens_are_plain_greedy_decodings():
    prompt = _prompt()
    found = speculate(small_model(NAME), prompt, NEW)
    assert found.tokens == _plain(prompt)
    # The first token comes from the prefill, then one per rejected draft and two per
    # accepted one.
    assert len(found.tokens) == 1 + found.drafted + found.accepted
    assert 0 <= found.accepted <= found.drafted


@pytest.mark.parametrize("right", [True, False])
def test_drafts_are_verified_and_counted(monkeypatch, right):
    """Drafts from an oracle of the greedy continuation: each accepted one commits two
    tokens a pass; each wrong one is replaced by the model's choice."""
    prompt = _prompt(1)
    plain = _plain(prompt, SEQ_LEN - len(prompt))
    full = np.asarray([*prompt, *plain, 0, 0, 0])
    real = speculative_module._draft

    def oracle(graphdef, state, hidden, next_tokens, cache, index):
        _, cache = real(graphdef, state, hidden, next_tokens, cache, index)
        width = next_tokens.shape[1]
        ahead = full[int(index) + 2 : int(index) + 2 + width]
        return np.asarray([ahead if right else (ahead + 1) % 256]), cache

    monkeypatch.setattr(speculative_module, "_draft", oracle)
    found = speculate(small_model(NAME), prompt, NEW)
    assert found.tokens == plain[:NEW]
    assert found.accepted == (found.drafted if right else 0)
    assert found.drafted == ((NEW - 1 + 1) // 2 if right else NEW - 1)


def test_a_stop_token_ends_the_continuation_before_it():
    prompt = _prompt(2)
    plain = _plain(prompt)
    stop = plain[3]
    first = plain.index(stop)
    assert speculate(small_model(NAME), prompt, NEW, stop_ids=[stop]).tokens == plain[:first]


def test_a_model_without_modules_is_refused():
    with pytest.raises(ValueError, match="no multi-token prediction module"):
        speculate(small_model("mixtral-tiny"), _prompt(), NEW)
