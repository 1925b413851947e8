"""Context-parallel attention equals attention over the whole sequence, and every device of
the context group does the same work.

Each case splits a row of 32 positions over a context group of 2 or 4 devices (chunks of 8
or 4 positions; tiles of 4, so a chunk's pieces loop over tiles too), runs the ring or the
all-gather exchange per device in a ``shard_map``, and compares the outputs and the
gradients of q, k and v with the dense reference core on the whole rows: float32, within
2e-5. Three broken variants (the ring turned the wrong way, the pieces merged without
rescaling their softmax, the own block without its causal mask) must fail the same
comparison of outputs, so the comparison is known to see each. The cases of one group size
run side by side in one compiled program, and so do the broken variants' forward passes.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jaxmoe.config import ParallelConfig
from jaxmoe.config.layout import CONTEXT
from jaxmoe.layers import blockwise_attention as blockwise
from jaxmoe.layers import context_attention as ring
from jaxmoe.layers.attention_core import dense_attention
from jaxmoe.parallel.mesh import build_mesh, role_axes
from jaxmoe.parallel.sequence_split import context_slice, zigzag_order

SEQ, HEADS, KV_HEADS, HEAD_DIM, VALUE_DIM = 32, 4, 2, 8, 12


@dataclasses.dataclass(frozen=True)
class Case:
    context: int
    exchange: str
    documents: bool = False


CASES = {
    "ring2": Case(2, "ring"),
    "ring4-documents": Case(4, "ring", documents=True),
    "all_gather4": Case(4, "all_gather"),
    "all_gather2-documents": Case(2, "all_gather", documents=True),
}


@functools.cache
@jax.jit
def _operands():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    query = jax.random.normal(keys[0], (2, SEQ, HEADS, HEAD_DIM))
    key = jax.random.normal(keys[1], (2, SEQ, KV_HEADS, HEAD_DIM))
    value = jax.random.normal(keys[2], (2, SEQ, KV_HEADS, VALUE_DIM))
    weights = jax.random.normal(keys[3], (2, SEQ, HEADS, VALUE_DIM))
    # Two rows of packed documents, their boundaries inside chunks and on a chunk's edge.
    segments = jnp.asarray([[0] * 5 + [1] * 14 + [2] * 13, [0] * 8 + [1] * 24], jnp.int32)
    return query, key, value, weights, segments


@functools.cache
def _reference(documents: bool):
    """The dense core's output on the whole rows and its gradients of q, k and v."""
    query, key, value, weights, segments = _operands()
    segments = segments if documents else None

    def loss(query, key, value):
        out = dense_attention(query, key, value, segments)
        return jnp.sum(out * weights), out

    reference = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(reference)(query, key, value)
    return out, grads


def _on_context_group(context: int, per_device, *operands):
    """``per_device`` on every device of a mesh with context groups of ``context``, each
    device given the whole operands; one compiled program."""
    mesh = build_mesh(ParallelConfig(data=4, expert=2, context=context))
    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(),) * len(operands),
        out_specs=PartitionSpec(),
        check_vma=False,
    )
    return jax.jit(mapped)(*operands)


def _split_attention(case: Case, query, key, value, segments):
    """This device's output of ``case``'s context attention, on its chunks of the rows."""
    local = [context_slice(x) for x in (query, key, value)]
    return ring.context_attention(
        *local,
        exchange=case.exchange,
        block=4,
        segment_ids=segments if case.documents else None,
    )


def _in_place(out, context: int):
    """Every device's rows of the group at their positions."""
    order = np.argsort(zigzag_order(SEQ, context))
    return jax.lax.all_gather(out, role_axes(CONTEXT), axis=1, tiled=True)[:, order]


def _split_with_gradients(case: Case, query, key, value, weights, segments):
    """Per device: the group's output and the full gradients of q, k and v (summed over
    the group) of ``case``'s split run."""

    def loss(query, key, value):
        out = _split_attention(case, query, key, value, segments)
        return jnp.sum(out * context_slice(weights)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(query, key, value)
    axes = role_axes(CONTEXT)
    return _in_place(out, case.context), jax.tree.map(lambda g: jax.lax.psum(g, axes), grads)


@functools.cache
def _context_parallel(context: int) -> dict:
    """Each case of a group of ``context`` devices by name: its outputs and gradients of
    the split run. The group's cases run side by side in one program."""
    cases = {name: case for name, case in CASES.items() if case.context == context}

    def per_device(*operands):
        return {name: _split_with_gradients(case, *operands) for name, case in cases.items()}

    return _on_context_group(context, per_device, *_operands())


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_attention_is_attention_over_the_whole_sequence(name):
    expected_out, expected_grads = _reference(documents=CASES[name].documents)
    out, grads = _context_parallel(CASES[name].context)[name]
    np.testing.assert_allclose(out, expected_out, rtol=2e-5, atol=2e-5)
    for got, want, name in zip(grads, expected_grads, ("dq", "dk", "dv"), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=name)


PPERMUTE = jax.lax.ppermute


def _backwards_ring(block, axes, perm):
    return PPERMUTE(block, axes, [(j, i) for i, j in perm])


def _unscaled_merge(a, b):
    (out_a, lse_a), (out_b, lse_b) = a, b
    return out_a + out_b, jnp.logaddexp(lse_a, lse_b)


def _own_block_unmasked(q, k, v, *, block, causal, **kwargs):
    return blockwise.attention_with_lse(q, k, v, block=block, causal=False, **kwargs)


BROKEN = {
    "wrong block order": ("jax.lax.ppermute", _backwards_ring),
    "no softmax rescale": ("_merge", _unscaled_merge),
    "no causal mask": ("attention_with_lse", _own_block_unmasked),
}


@functools.cache
def _broken_outputs() -> dict:
    """Each broken variant's output of the ring over 4 devices without documents, by name:
    the variants side by side in one program, each traced with its replacement in place."""
    case = Case(4, "ring")

    def per_device(query, key, value):
        outputs = {}
        for broken, (target, replacement) in BROKEN.items():
            with pytest.MonkeyPatch.context() as patch:
                if target == "jax.lax.ppermute":
                    patch.setattr(ring.jax.lax, "ppermute", replacement)
                else:
                    patch.setattr(ring, target, replacement)
                out = _split_attention(case, query, key, value, None)
            outputs[broken] = _in_place(out, case.context)
        return outputs

    query, key, value, _, _ = _operands()
    return _on_context_group(case.context, per_device, query, key, value)


@pytest.mark.parametrize("broken", list(BROKEN))
def test_the_comparison_fails_for_a_broken_ring(broken):
    expected_out, _ = _reference(documents=False)
    out = _broken_outputs()[broken]
    assert not np.allclose(out, expected_out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_every_device_computes_the_causal_chunk_pairs_it_needs_and_no_more(devices):
    chunk = 16
    work = []
    for device in range(devices):
        pairs = ring.chunk_pairs(device, devices)
        # A query chunk needs every key chunk up to its own, its own under the causal mask.
        own = (device, 2 * devices - 1 - device)
        needed = {(q, k, q == k) for q in own for k in range(q + 1)}
        assert sorted(pairs) == sorted(needed)
        work.append(sum(chunk * (chunk + 1) // 2 if causal else chunk**2 for *_, causal in pairs))
    # Equal work within 5% (here exactly): the zig-zag split balances the causal mask.
    assert max(work) <= 1.05 * min(work)
    assert len(set(work)) == 1
