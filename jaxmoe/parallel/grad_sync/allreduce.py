"""``allreduce``: each gradient summed over the axes its parameter is replicated on.

One psum per parameter (XLA combines them); every replica applies the exact
gradient of the global mean loss. The reference the other algorithms are
measured against.
"""

from __future__ import annotations

from jaxmoe.parallel.grad_sync.base import GradSync, MeshAxes, PyTree, Synced
from jaxmoe.parallel.sharding import reduce_gradients


class AllReduce(GradSync):
    def __call__(self, grads: PyTree, state: PyTree, specs: PyTree, mesh_axes: MeshAxes) -> Synced:
        del mesh_axes
        return Synced(reduce_gradients(grads, specs), state)
