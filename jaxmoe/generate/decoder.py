"""Decoding with a key/value cache: a prefill of the prompt, then one compiled step per
token.

The prompt goes through the model in one call of :meth:`~jaxmoe.layers.GPTMoE.decode`
at position 0, which fills every layer's cache ``[batch, max_len, kv_heads, head_dim]``
and gives the first new token; each further token is one call at the next position
(``new = 1``). Both are compiled once per shape: the cache length is static, the
position and the sampling settings are traced values, so every step after the first
runs the same program, whatever the settings.

MoE layers decode **dropless** (:func:`inference_moe`): capacity is a training device
(static shapes, balanced devices); at inference a token's output must not depend on the
other tokens that share its routing group, or the cached decoding would differ from a
forward pass over the whole sequence, and from the Hugging Face models, which never
drop. Each token goes to its top-k experts as the trained router chooses them (no
router noise; the expert biases of auxiliary-loss-free balancing, if any, included).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmoe.config import MoEConfig
from jaxmoe.generate.sampling import Sampling, choose_next
from jaxmoe.layers import GPTMoE
from jaxmoe.layers.block import LayerCache

Cache = tuple[LayerCache, ...]
GREEDY = Sampling()


def inference_moe(moe: MoEConfig) -> MoEConfig:
    """``moe`` for decoding: dropless, one routing group per row, no router noise (the
    parameters are the same)."""
    return dataclasses.replace(moe, capacity_factor=None, group_size=None, jitter=0.0)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _forward(graphdef: nnx.GraphDef, state: nnx.State, tokens, cache: Cache, index):
    return nnx.merge(graphdef, state).decode(tokens, cache, index)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _next_token(graphdef, state, tokens, cache: Cache, index, key, sampling):
    logits, cache = nnx.merge(graphdef, state).decode(tokens, cache, index)
    return choose_next(logits[:, -1], key, *sampling), cache


class Decoder:
    """A model ready to decode on one device (build it with :func:`inference_moe`)."""

    def __init__(self, model: GPTMoE):
        self.config = model.config
        self.graphdef, self.state = nnx.split(model)
        self._model = model

    @property
    def max_len(self) -> int:
        """The longest sequence, prompt and continuation: ``model.seq_len``."""
        return self.config.seq_len

    def init_cache(self, batch: int, max_len: int) -> Cache:
        return self._model.init_cache(batch, max_len)

    def forward(self, tokens, cache: Cache, index: int) -> tuple[jax.Array, Cache]:
        """Logits ``[batch, new, vocab]`` of ``tokens [batch, new]`` at positions ``index``
        on, and the cache extended by them (the cache passed in is consumed)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        return _forward(self.graphdef, self.state, tokens, cache, jnp.int32(index))

    def generate(
        self,
        prompt: np.ndarray | Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        *,
        seed: int = 0,
        stop_ids: Sequence[int] = (),
    ) -> list[list[int]]:
        """Continue each row of ``prompt [batch, length]`` (rows of one length) by up to
        ``max_new_tokens`` tokens, fewer where a row reaches a token of ``stop_ids`` (left
        out of its continuation) or the sequence reaches ``model.seq_len``.

        Sampling draws from ``jax.random.key(seed)``, folded with each token's position."""
        prompt = np.asarray(prompt, np.int32)
        if prompt.ndim != 2 or prompt.shape[1] == 0:
            raise ValueError(f"a prompt [batch, length >= 1], not of shape {prompt.shape}")
        batch, length = prompt.shape
        if length > self.max_len:
            raise ValueError(f"a prompt of {length} tokens: model.seq_len is {self.max_len}")
        steps = min(max_new_tokens, self.max_len - length)
        if steps <= 0:
            return [[] for _ in range(batch)]
        cache = self.init_cache(batch, length + steps)
        key = jax.random.key(seed)
        stops = np.asarray(list(stop_ids), np.int32)
        continuations: list[list[int]] = [[] for _ in range(batch)]
        done = np.zeros(batch, bool)
        settings = sampling.arrays()
        tokens, index = jnp.asarray(prompt), 0
        for _ in range(steps):
            chosen, cache = _next_token(
                self.graphdef,
                self.state,
                tokens,
                cache,
                jnp.int32(index),
                jax.random.fold_in(key, index + tokens.shape[1]),
                settings,
            )
            index += tokens.shape[1]
            host = np.asarray(chosen)
            for row in np.flatnonzero(~done):
                if host[row] in stops:
                    done[row] = True
                else:
                    continuations[row].append(int(host[row]))
            if done.all():
                break
            tokens = chosen[:, None]
        return continuations
