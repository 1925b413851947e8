"""Recomputation of a block (``model.recompute``): what its backward pass computes again
instead of keeping from the forward pass.

Full-layer recomputation (``"layer"``): each block's forward pass runs again in the
backward pass, from the block's input, instead of keeping its activations.

Every block is called through :func:`call_block`. Under ``"layer"`` the call runs under
``jax.checkpoint`` with JAX's default policy (nothing saved but the arguments) and
``prevent_cse``: the backward pass of block i runs block i's forward pass again, every
collective in it included (the expert all-to-alls and the tensor-parallel gathers and
reduce-scatters run once more per step, besides their transposes), then its transpose.
Between the forward and the backward pass a block keeps its input alone, ``[rows,
positions, d_model]`` (Megatron-Core's ``--recompute-granularity full
--recompute-method uniform`` with one layer per group); its parameters are the state's.

``prevent_cse`` puts an ``optimization_barrier`` on the recomputation's inputs, without
which XLA may merge the recomputation with the forward values it repeats and keep those
alive after all. XLA:GPU, and XLA:CPU from jax 0.11.2, keep that barrier until the step
is scheduled; XLA:CPU up to jax 0.10.2 dropped it first, and there the compiled memory
did not fall (``docs/xla_notes.md``).

How a block is called is the caller's: the plain call, or under fully sharded parameters
(``train.zero 3``) the block's gather and call (:func:`jaxmoe.parallel.fsdp.gathering_call`),
so that the recomputed call gathers the block's parameters once more in the backward
pass, as it does without recomputation. Such a call names the values it gathers
(:class:`Regathering`), and no policy keeps them: ``"matmuls"`` keeps the exchanges'
results, and would otherwise keep every block's gathered parameters to the backward pass.

``"matmuls"`` (MaxText's ``minimal`` remat policy) keeps the results of a block's
matmuls (projections, FFNs, the experts' grouped GEMMs), of its exchanges (the
all-to-alls, the tensor-parallel gathers and reduce-scatters) and of its flash attention
core (its output and rows' log-sum-exp, named
:data:`~jaxmoe.layers.blockwise_attention.RESIDUALS`, or cuDNN's fused forward pass) and
recomputes the rest: norms, activations, routing. So the backward pass repeats no matmul
and no collective, and the flash core's backward pass recomputes its scores tile by
tile, as it always does. The core's residuals must be kept by name: JAX applies a
checkpoint's policy inside every checkpoint nested in it, and recomputing the blockwise
core's loop under this policy would keep the scores of every tile, the matmuls of its
iterations (over 5 GB a layer for Qwen2-57B-A14B at four sequences of 4096). The dense
core's scores are a matmul's result, and ``"matmuls"`` keeps them (it is the reference
core; ``"attention"`` recomputes it).
``"matmuls_offload"`` keeps the same values in host memory (``pinned_host``), copied out
in the forward pass and back in the backward one: a block then holds on the device only
its input, as under ``"layer"``, without recomputing its matmuls. It needs a backend with
pinned host memory (:func:`offload_available`: GPU, TPU, and XLA:CPU as of jax 0.12,
where host and device memory are one and the policy computes the same values).

``"attention"`` (selective, Megatron-Core's default) recomputes the dense core attention
only (:mod:`jaxmoe.layers.attention`); the flash cores keep nothing to recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.ad_checkpoint
from flax import nnx

from jaxmoe.layers.blockwise_attention import RESIDUALS as FLASH_RESIDUALS
from jaxmoe.layers.fp8 import PRODUCT as FP8_PRODUCT

# How a block is called: ``(block, index, *args) -> block's outputs``.
BlockCall = Callable[..., Any]


@runtime_checkable
class Regathering(Protocol):
    """A block call that gathers the block's parameters (ZeRO-3) and gathers them again in
    the backward pass: ``regathered(index)`` tells those gathers among the values block
    ``index`` makes, ``(primitive, **params) -> bool``."""

    def __call__(self, block: nnx.Module, index: int, *args: Any) -> Any: ...

    def regathered(self, index: int) -> Callable[..., bool]: ...


def plain_call(block: nnx.Module, index: int, *args: Any) -> Any:
    """``block(*args)``: a block whose parameters are whole on every device."""
    del index
    return block(*args)


# The primitives whose results "matmuls" keeps: the matmuls and the exchanges.
KEPT_PRIMITIVES = frozenset(
    {"dot_general", "ragged_dot_general", "all_to_all", "ragged_all_to_all", "all_gather",
     "reduce_scatter", "psum", "psum_invariant", "ppermute"}
)  # fmt: skip
# cuDNN's fused attention forward pass as jax.nn.dot_product_attention's custom_vjp binds it
# in training: its results are the output and the softmax statistics, the residuals of its
# backward pass.
CUDNN_ATTENTION_FORWARD = frozenset({"dot_product_attention_fwd_wrapper"})
# The values "matmuls" keeps by name: FP8 products (their dots sit in a custom_vjp,
# jaxmoe/layers/fp8.py) and the flash cores' residuals.
KEPT_NAMES = frozenset({FP8_PRODUCT, FLASH_RESIDUALS})
HOST = "pinned_host"


def _kept(primitive: Any, params: dict[str, Any]) -> bool:
    """A matmul's, an exchange's or a flash attention's result (by primitive or by name)."""
    if primitive.name == "name":
        return params.get("name") in KEPT_NAMES
    return primitive.name in KEPT_PRIMITIVES or primitive.name in CUDNN_ATTENTION_FORWARD


def _keeps_matmuls(primitive: Any, *_: Any, **params: Any) -> bool:
    return _kept(primitive, params)


def _offloads_matmuls(primitive: Any, *_: Any, **params: Any) -> Any:
    if _kept(primitive, params):
        return jax.ad_checkpoint.Offloadable(src="device", dst=HOST)
    return False


# The jax.checkpoint policy of each recomputation of a whole block.
POLICIES = {
    "layer": None,  # JAX's default: nothing kept but the block's arguments
    "matmuls": _keeps_matmuls,
    "matmuls_offload": _offloads_matmuls,
}


def offload_available() -> bool:
    """Whether the default device has pinned host memory to offload to."""
    memories = jax.devices()[0].addressable_memories()
    return any(memory.kind == HOST for memory in memories)


def recomputed(
    block: nnx.Module, index: int, call: BlockCall, *args: Any, recompute: str = "layer"
) -> Any:
    """``call(block, index, *args)``, its activations recomputed in the backward pass as
    ``recompute`` says (:data:`POLICIES`)."""
    graphdef, state = nnx.split(block)
    policy = POLICIES[recompute]
    if call is plain_call:
        run = _plain_run(graphdef)
    else:

        def run(state: Any, args: tuple[Any, ...]) -> Any:
            return call(nnx.merge(graphdef, state), index, *args)

        if policy is not None and isinstance(call, Regathering):
            policy = _except(policy, call.regathered(index))
    return jax.checkpoint(run, prevent_cse=True, policy=policy)(state, args)


# The recomputed function of a plainly called block, one per block definition: JAX keys
# its traces of a checkpoint (and their derivatives and transposes) on the function and
# its arguments' shapes, so identical blocks are traced once per step, not once each.
# Bounded: a model has few distinct blocks, and a function kept keeps its traces.
@functools.lru_cache(maxsize=16)
def _plain_run(graphdef: nnx.GraphDef) -> Callable[[Any, tuple[Any, ...]], Any]:
    def run(state: Any, args: tuple[Any, ...]) -> Any:
        return plain_call(nnx.merge(graphdef, state), 0, *args)  # it reads no index

    return run


def _except(policy: Callable[..., Any], regathered: Callable[..., bool]) -> Callable[..., Any]:
    """``policy``, keeping none of the values ``regathered`` tells."""

    def keeps(primitive: Any, *args: Any, **params: Any) -> Any:
        return False if regathered(primitive, **params) else policy(primitive, *args, **params)

    return keeps


def call_block(
    recompute: str, block: nnx.Module, index: int, *args: Any, call: BlockCall | None = None
) -> Any:
    """Block ``index`` called on ``args`` through ``call`` (default :func:`plain_call`),
    under :func:`recomputed` when ``recompute`` (``model.recompute``) recomputes blocks."""
    call = call or plain_call
    if recompute in POLICIES:
        if recompute == "matmuls_offload" and not offload_available():
            raise ValueError(
                f"model.recompute=matmuls_offload: the {jax.default_backend()} backend has no "
                f"{HOST} memory to offload to; use model.recompute=matmuls"
            )
        return recomputed(block, index, call, *args, recompute=recompute)
    return call(block, index, *args)
