"""Cached decoding of the converted ``transformers`` fixture models (``tests/fixtures/hf``,
``tools/make_hf_fixtures.py``) against the logits ``transformers`` computed.

The fixtures hold a forward pass over fixed ids (``token_ids.npy``, ``logits.npy``) and
the greedy continuation ``generate`` gave from their first 8 ids (``greedy_ids.npy``):
fed the same ids one at a time after a prefill, the cache must give the same logits at
every position, and greedy decoding the same continuation."""

from pathlib import Path

import numpy as np
import pytest

from jaxmoe.generate import Decoder, load_run_model

convert = pytest.importorskip("jaxmoe.hf.convert")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
# A fixture whose model another fixture holds in another dtype decodes the same way: its
# case is in the slow tier.
FAMILIES = [
    pytest.param(p.name, marks=pytest.mark.slow) if p.name.endswith("_fp8") else p.name
    for p in (sorted(FIXTURES.iterdir()) if FIXTURES.is_dir() else [])
]
PREFILL = 6


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_of_a_converted_model_gives_the_transformers_logits(family, tmp_path):
    out = tmp_path / "run"
    convert.from_hf(convert.plan_from_hf(FIXTURES / family), out)
    decoder = Decoder(load_run_model(out).model)
    ids = np.load(FIXTURES / family / "token_ids.npy")
    expected = np.load(FIXTURES / family / "logits.npy")

    cache = decoder.init_cache(ids.shape[0], ids.shape[1])
    logits, cache = decoder.forward(ids[:, :PREFILL], cache, 0)
    steps = [np.asarray(logits)]
    for position in range(PREFILL, ids.shape[1]):
        logits, cache = decoder.forward(ids[:, position : position + 1], cache, position)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, rtol=1e-4, atol=1e-4)

    greedy = np.load(FIXTURES / family / "greedy_ids.npy")
    prompt = 8
    continuation = decoder.generate(greedy[:, :prompt], greedy.shape[1] - prompt)
    assert continuation == greedy[:, prompt:].tolist()
