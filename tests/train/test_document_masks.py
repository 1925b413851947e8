"""Packed documents: with ``data.mask_across_documents`` attention, positions and the loss
stay inside each document, on the model and through the sharded eval step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxmoe.config import (
    Config,
    DataConfig,
    DataSource,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
)
from jaxmoe.data.corpus import CorpusInfo, write_info
from jaxmoe.data.documents import document_masks
from jaxmoe.layers import GPTMoE
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.train.resolved import resolve
from jaxmoe.train.state import init_train_state
from jaxmoe.train.step import build_eval_step

EOD = 1
SEQ = 16
GPT = ModelConfig(vocab_size=64, d_model=32, num_heads=2, num_layers=2, d_ff=64, seq_len=SEQ)
LLAMA = dataclasses.replace(
    GPT, norm="rmsnorm", position="rope", activation="swiglu", linear_bias=False,
    num_kv_heads=1, tie_embeddings=False,
)  # fmt: skip
DROPLESS = MoEConfig(num_experts=4, top_k=2, capacity_factor=None)


@nnx.jit
def _logits(net: GPTMoE, tokens, masks=None):
    """The model's logits, compiled once per shape (run op by op, its hundreds of ops would
    each be compiled)."""
    positions, segment_ids = (None, None) if masks is None else masks
    logits, _ = net(tokens, None, None, positions, segment_ids)
    return logits


def _row(rng, first: int) -> np.ndarray:
    """A window of SEQ + 1 tokens: ``first`` tokens of one document, EOD, another."""
    row = rng.integers(2, 64, SEQ + 1)
    row[first] = EOD
    return row


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt2", "llama"])
def test_a_document_does_not_see_the_one_before_it(model):
    net = nnx.jit(lambda: GPTMoE(model, DROPLESS, rngs=nnx.Rngs(0)))()  # one compilation
    rng = np.random.default_rng(1)
    first = 6  # tokens 0..5 one document, 6 its EOD, 7.. the next
    row = _row(rng, first)
    other = row.copy()
    other[:first] = rng.integers(2, 64, first)  # another first document, same length

    def logits(row):
        batch = jnp.asarray(row[None])
        masks = document_masks(batch, EOD)
        return np.asarray(_logits(net, batch[:, :-1], (masks.positions, masks.segment_ids))[0])

    a, b = logits(row), logits(other)
    np.testing.assert_allclose(a[first + 1 :], b[first + 1 :], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:first], b[:first], atol=1e-3)
    # The second document is what it would be at the start of a row of its own.
    alone = _logits(net, jnp.asarray(row[None, first + 1 : -1]))
    np.testing.assert_allclose(a[first + 1 :], np.asarray(alone[0]), rtol=1e-5, atol=1e-5)


def test_the_eval_loss_is_the_mean_over_the_targets_inside_documents(tmp_path):
    corpus = tmp_path / "corpus.bin"
    np.arange(4 * SEQ, dtype="<u2").tofile(corpus)
    info = CorpusInfo("uint16", 64, EOD, "<eod>", None, documents=4, tokens=4 * SEQ)
    write_info(corpus, info)
    config = Config(
        model=GPT,
        moe=DROPLESS,
        parallel=ParallelConfig(data=2, expert=4),
        train=TrainConfig(batch_size=8),
        data=DataConfig(sources=(DataSource(str(corpus)),), mask_across_documents=True),
    )
    mesh = build_mesh(config.parallel)
    state = init_train_state(resolve(config, mesh))
    rng = np.random.default_rng(2)
    rows = np.stack([_row(rng, first) for first in (0, 3, 5, 7, 9, 11, 13, SEQ)]).astype(np.int32)
    batch = jax.device_put(rows, jax.sharding.NamedSharding(mesh, token_spec(mesh)))

    loss = build_eval_step(resolve(config, mesh)).jit()(state.params, batch, None, None)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPTMoE(GPT, DROPLESS, rngs=nnx.Rngs(0))))
    net = nnx.merge(graphdef, jax.device_get(state.params))
    masks = document_masks(jnp.asarray(rows), EOD)
    logits = _logits(net, jnp.asarray(rows[:, :-1]), (masks.positions, masks.segment_ids))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(rows[:, 1:]))
    counted = np.asarray(masks.loss_mask, np.float64)
    expected = float(np.sum(np.asarray(ce) * counted) / counted.sum())
    assert counted.sum() == 8 * SEQ - 7  # one target after each EOD inside a window
    assert float(loss) == pytest.approx(expected, rel=1e-5)
