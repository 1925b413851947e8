"""Speculative decoding with multi-token prediction's first module as the drafter
(DeepSeek-V3's use of its MTP module at inference), greedy: the same tokens as
:meth:`~jaxmoe.generate.Decoder.generate` at temperature 0, in fewer passes of the
model when drafts are accepted.

After each committed token, the module (:meth:`~jaxmoe.layers.GPTMoE.decode_draft`)
drafts the token after it from the model's last hidden state and the committed token.
One pass of the model over the committed token and the draft (two positions) then
verifies it: where the model's own choice after the committed token is the draft, the
draft is accepted and the pass has also chosen the token after it (two tokens for one
pass); otherwise the model's choice replaces the draft (one token, as plain decoding).
Either way the module then drafts from the hidden states the pass made. A rejected
draft's keys and values stay in the model's cache beyond the committed positions, where
attention does not look, until the next pass overwrites them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.layers import GPTMoE


@dataclass(frozen=True)
class Speculation:
    """A continuation, and how many drafts were verified and accepted."""

    tokens: list[int]
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _verify(graphdef: nnx.GraphDef, state: nnx.State, tokens, cache, index):
    logits, hidden, cache = nnx.merge(graphdef, state).decode_hidden(tokens, cache, index)
    return jnp.argmax(logits, axis=-1), hidden, cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _draft(graphdef: nnx.GraphDef, state: nnx.State, hidden, next_tokens, cache, index):
    logits, cache = nnx.merge(graphdef, state).decode_draft(hidden, next_tokens, cache, index)
    return jnp.argmax(logits, axis=-1), cache


def why_not_speculative(model: GPTMoE) -> str | None:
    """Why ``model`` cannot draft its tokens, or None when it can."""
    if not model.config.mtp_depth:
        return "the model has no multi-token prediction module (model.mtp_depth is 0)"
    return None


def speculate(
    model: GPTMoE, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
) -> Speculation:
    """Continue ``prompt`` (one row) greedily by up to ``max_new_tokens`` tokens, fewer at a
    token of ``stop_ids`` (left out) or at ``model.seq_len`` positions (module docstring)."""
    reason = why_not_speculative(model)
    if reason is not None:
        raise ValueError(f"speculative decoding: {reason}")
    length = len(prompt)
    if not 1 <= length <= model.config.seq_len:
        raise ValueError(f"a prompt of 1 to model.seq_len={model.config.seq_len} tokens")
    steps = min(max_new_tokens, model.config.seq_len - length)
    if steps <= 0:
        return Speculation([], 0, 0)
    graphdef, state = nnx.split(model)
    # Verification writes one position past the last committed token.
    cache = model.init_cache(1, length + steps + 1)
    draft_cache = model.init_draft_cache(1, length + steps + 1)
    rows = jnp.asarray([list(prompt)], jnp.int32)
    chosen, hidden, cache = _verify(graphdef, state, rows, cache, jnp.int32(0))
    committed = int(chosen[0, -1])
    tokens: list[int] = []
    stops = set(stop_ids)

    def emit(token: int) -> bool:
        """Commit ``token``; whether decoding goes on."""
        if token in stops:
            return False
        tokens.append(token)
        return len(tokens) < steps

    if not emit(committed):
        return Speculation(tokens, 0, 0)
    ahead = jnp.concatenate([rows[:, 1:], jnp.asarray([[committed]], jnp.int32)], axis=1)
    drafts, draft_cache = _draft(graphdef, state, hidden, ahead, draft_cache, jnp.int32(0))
    draft, position, drafted, accepted = int(drafts[0, -1]), length, 0, 0
    while True:
        pair = jnp.asarray([[committed, draft]], jnp.int32)
        chosen, hidden, cache = _verify(graphdef, state, pair, cache, jnp.int32(position))
        drafted += 1
        choice = int(chosen[0, 0])
        if choice == draft:
            accepted += 1
            after = int(chosen[0, 1])
            if not emit(draft) or not emit(after):
                break
            following = jnp.asarray([[draft, after]], jnp.int32)
            drafts, draft_cache = _draft(
                graphdef, state, hidden, following, draft_cache, jnp.int32(position)
            )
            committed, draft, position = after, int(drafts[0, 1]), position + 2
        else:
            if not emit(choice):
                break
            following = jnp.asarray([[choice]], jnp.int32)
            drafts, draft_cache = _draft(
                graphdef, state, hidden[:, :1], following, draft_cache, jnp.int32(position)
            )
            committed, draft, position = choice, int(drafts[0, 0]), position + 1
    return Speculation(tokens, drafted, accepted)
