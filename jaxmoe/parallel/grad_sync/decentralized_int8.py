"""``decentralized-int8``: ``decentralized`` with the parameters exchanged as 8-bit codes.

Each worker (one host's replicas, :mod:`.workers`) steps on its own gradient, as in
:mod:`.decentralized`; then, per bucket of parameters (fused as in :mod:`.bucketed`,
each parameter starting on a chunk of its own so that a chunk's range is one
parameter's), every worker quantises its parameters (each member of a host its share)
with the per-chunk min/max quantiser of :mod:`.quantize`, sends the codes (1 byte per
value plus two floats per chunk) to its neighbours on the ring of hosts, and moves by
the ring's weights times the differences of the decoded values::

    x_h <- x_h + sum_k w_hk (D(Q(x_k)) - D(Q(x_h)))

(``w_hk`` = 1/3 for the two neighbours on a ring of 3 or more hosts, 1/2 for the peer
of a pair). Its own exact ``x_h`` stays: only the differences go through the
quantiser. This is the quantized gossip of Carli, Fagnani, Frasca and Zampieri
("Gossip consensus algorithms via quantized communication", Automatica 2010), which
has two properties that matter here. The mean over workers is exactly preserved (each
difference is added to one worker and taken from another, W being doubly stochastic),
so the mean follows the mean of the updates as in ``decentralized``. And the error is
of the differences, not of the values: workers that agree send identical codes and do
not move; workers that differ are pulled together to within about one quantisation
step (a 255th of a chunk's range) of each other, where gossip of ``D(Q(x_k))`` in
place of ``x_k`` would add the quantisation error of ``x`` itself at every step,
however close the workers.

BAGUA's low-precision decentralized SGD (after Tang et al., "Communication Compression
for Decentralized Training", NeurIPS 2018) instead keeps copies of its neighbours'
parameters and sends compressed differences to those copies, which removes the
one-step floor at the cost of two parameter copies per replica and an exchange that
must see the algorithm's state after the update (this one needs neither). A host
sends 1 byte per value to each neighbour, a quarter of ``decentralized``'s 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmoe.parallel.grad_sync.decentralized import Decentralized
from jaxmoe.parallel.grad_sync.quantize import DEFAULT_CHUNK, Quantized, dequantize, quantize
from jaxmoe.parallel.grad_sync.workers import Replicas, host_perm, ring_shifts


def quantized_ring_mix(value: jax.Array, group: Replicas, chunk: int) -> jax.Array:
    """``value + sum_k w_hk (D(Q(x_k)) - D(Q(value)))`` over this worker's neighbours on the
    ring of hosts (the peer of a pair; nothing for one host)."""
    shifts = ring_shifts(group.hosts)
    if not shifts:
        return value
    q = quantize(value, chunk)
    received = [
        [jax.lax.ppermute(part, group.axes, host_perm(group.across, shift)) for part in q]
        for shift in shifts
    ]
    # Own and received codes decoded by one computation: equal codes decode to equal
    # values, so workers that agree do not move (two decodings may round differently).
    stacked = Quantized(*(jnp.stack(parts) for parts in zip(q, *received, strict=True)))
    decoded = dequantize(stacked, value.shape, jnp.float32)
    pull = jnp.sum(decoded[1:] - decoded[0], axis=0)
    return (value.astype(jnp.float32) + pull / (1 + len(shifts))).astype(value.dtype)


@dataclass(frozen=True)
class DecentralizedInt8(Decentralized):
    chunk: int = DEFAULT_CHUNK

    def mix(self, share: jax.Array, group: Replicas) -> jax.Array:
        return quantized_ring_mix(share, group, self.chunk)

    @property
    def align(self) -> int:
        return self.chunk  # shares of whole chunks, so that each chunk keeps to one parameter
