"""Column- and row-parallel linear layers (Megatron tensor parallelism).

Both are ``nnx.Linear`` with the same parameter names, shapes and
initialisation, so the parameter tree (and a checkpoint) is the same with or
without tensor parallelism; they only declare how their parameters split over
the ``tensor`` role (``parallel_axes``, :mod:`jaxmoe.parallel.sharding`).
Inside the whole-step shard_map each device holds its block and the layers
compute on it:

- :class:`ColumnParallelLinear` splits the output features (kernel columns
  and bias): each device computes its block of the outputs from the whole
  input, no collective.
- :class:`RowParallelLinear` splits the input features (kernel rows): each
  device computes a partial sum over its input block; the partial sums are
  reduce-scattered along the sequence and the (replicated) bias is added once,
  after the reduction, to this device's slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config.layout import TENSOR
from jaxmoe.layers.fp8 import contract
from jaxmoe.layers.fp8 import dot_general as fp8_dot_general
from jaxmoe.parallel.tensor_parallel import scatter_sequence


class ColumnParallelLinear(nnx.Linear):
    """``nnx.Linear`` whose output features are split over the tensor group (its product
    in FP8 by the ``fp8`` recipe, :mod:`jaxmoe.layers.fp8`)."""

    def __init__(self, in_features: int, out_features: int, *, fp8: str = "none", **kwargs):
        super().__init__(
            in_features,
            out_features,
            kernel_metadata={"parallel_axes": (None, TENSOR)},
            bias_metadata={"parallel_axes": (TENSOR,)},
            dot_general=fp8_dot_general(fp8),
            **kwargs,
        )


class RowParallelLinear(nnx.Linear):
    """``nnx.Linear`` whose input features are split over the tensor group; its output
    leaves the tensor-parallel region: ``[rows, seq, in / tensor] -> [rows, seq / tensor,
    out]`` (its product in FP8 by the ``fp8`` recipe)."""

    def __init__(self, in_features: int, out_features: int, *, fp8: str = "none", **kwargs):
        super().__init__(
            in_features,
            out_features,
            kernel_metadata={"parallel_axes": (TENSOR, None)},
            dot_general=fp8_dot_general(fp8),
            **kwargs,
        )

    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        partial = self.dot_general(
            inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision
        )
        y = scatter_sequence(partial)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


class HeadProjection(nnx.Module):
    """``x [..., d_model] -> [..., *features]``: a kernel ``[d_model, *features]`` and an
    optional bias ``[*features]``, both split over the roles of ``parallel_axes`` (one per
    feature axis), the split applied as it is found in the arrays (a shard inside the
    whole-step shard_map). The projections into heads (query, keys and values) and the
    fused gate and up matrices of SwiGLU use it; ``nnx.Einsum`` reshapes its bias to the
    declared shape, which a shard does not have. Its product is FP8 by the ``fp8`` recipe
    (:mod:`jaxmoe.layers.fp8`; ``"none"``: in ``dtype``)."""

    def __init__(
        self,
        d_model: int,
        features: tuple[int, ...],
        *,
        parallel_axes: tuple[str | None, ...],
        use_bias: bool,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        fp8: str = "none",
    ):
        self.dtype = dtype
        self.fp8 = fp8
        out_axes = tuple(range(1, len(features) + 1))
        init = nnx.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=out_axes
        )
        self.kernel = nnx.Param(
            init(rngs.params(), (d_model, *features)), parallel_axes=(None, *parallel_axes)
        )
        self.bias = (
            nnx.Param(jnp.zeros(features), parallel_axes=parallel_axes) if use_bias else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...].astype(self.dtype)
        y = contract(x.astype(self.dtype), kernel, self.fp8)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y
