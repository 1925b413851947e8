"""Toy per-device steps shaped like a folded tensor/expert-parallel layer (no jaxmoe).

Eight fake devices on a mesh of three axes of size 2. A layout names which mesh
axes form each group, as the folded mesh does: the tensor group (attention's
tensor parallelism, with sequence parallelism outside it), the expert group
(the MoE all-to-all) and the expert-tensor group (each expert's hidden
dimension split). Every device holds ``BATCH`` rows of its ``SEQ / tensor``
sequence positions; the batch is split over the non-tensor axes.

A layer, per device:

- ``layer_0/attention``: all_gather the sequence over the tensor axes, a
  column-parallel matmul, gelu, a row-parallel matmul, psum_scatter back to
  the sequence slice (Megatron's sequence-parallel block), and a residual add;
- ``layer_0/moe``: the tokens exchanged with an all_to_all over the expert
  axes, an expert FFN (with an all_gather / psum_scatter over the
  expert-tensor axes around it where that group is not one device), and the
  exchange back;

then the loss sums squares, ``jax.value_and_grad`` differentiates it, and each
gradient is summed (under ``grad_reduce``) over the mesh axes its parameter is
replicated on.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from scheduling import AxisRoles
from scheduling.program.capture import Program, capture
from tests.scheduling.toys import put, sds

BATCH = 8  # rows per device
SEQ = 16  # positions per row, before the tensor split
D = 4
FFN = 8  # hidden width of the dense block and of each expert, before any split
LR = 0.1


@dataclass(frozen=True)
class FoldedLayout:
    """Mesh axes (outermost first) and the axis tuple of each group."""

    axis_names: tuple[str, ...]
    tensor: tuple[str, ...]
    expert: tuple[str, ...]
    expert_tensor: tuple[str, ...]

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axis_names if a not in self.tensor)

    def size(self, axes: tuple[str, ...]) -> int:
        return 2 ** len(axes)  # every toy axis has size 2

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return _mesh(self.axis_names)


# The expert group spans the tensor axis: MoE all-to-all over ('expert', 'tensor_expert').
FOLDED = FoldedLayout(
    ("data", "expert", "tensor_expert"),
    tensor=("tensor_expert",),
    expert=("expert", "tensor_expert"),
    expert_tensor=(),
)
# Experts split over the tensor axis: an all_gather / psum_scatter around the expert FFN.
EXPERT_TENSOR = FoldedLayout(
    ("data", "expert", "tensor"), tensor=("tensor",), expert=("expert",), expert_tensor=("tensor",)
)
LAYOUTS = {"folded": FOLDED, "expert_tensor": EXPERT_TENSOR}


# The role each axis name of these toys plays in the attention and MoE layouts (the
# names of jaxmoe's folded mesh, given to scheduling as data, as jaxmoe gives them).
AXIS_ROLES = AxisRoles(
    {
        "data": ("data", "expert_data"),
        "expert": ("data", "expert"),
        "expert_tensor": ("data", "expert_tensor"),
        "tensor": ("tensor", "expert_tensor"),
        "tensor_expert": ("tensor", "expert"),
        "tensor_expert_data": ("tensor", "expert_data"),
    }
)


@functools.cache
def _mesh(axis_names: tuple[str, ...]) -> jax.sharding.Mesh:
    return jax.make_mesh((2,) * len(axis_names), axis_names)


def param_specs(layout: FoldedLayout) -> tuple[P, ...]:
    """w_col [D, FFN] and w_row [FFN, D] split over tensor; the experts' w_in [E*D, FFN] and
    w_out [E*FFN, D] split over the expert axes, the FFN width over expert-tensor."""
    tensor, expert, et = layout.tensor, layout.expert, layout.expert_tensor or None
    return (P(None, tensor), P(tensor, None), P(expert, et), P((*expert, *(et or ())), None))


def param_shapes(layout: FoldedLayout) -> tuple[tuple[int, int], ...]:
    experts = layout.size(layout.expert)
    return ((D, FFN), (FFN, D), (experts * D, FFN), (experts * FFN, D))


def _gelu(x):
    return jax.nn.gelu(x, approximate=True)


def make_loss(layout: FoldedLayout):
    tensor, expert, et = layout.tensor, layout.expert, layout.expert_tensor
    groups = layout.size(expert)

    def loss(params, x):
        w_col, w_row, w_in, w_out = params
        with jax.named_scope("layer_0/attention"):
            h = jax.lax.all_gather(x, tensor, axis=1, tiled=True)  # [B, SEQ, D]
            h = _gelu(h @ w_col) @ w_row
            h = jax.lax.psum_scatter(h, tensor, scatter_dimension=1, tiled=True)
            x = x + h
        with jax.named_scope("layer_0/moe"):
            b, s, _ = x.shape
            parts = x.reshape(b, groups, s // groups, D).transpose(1, 0, 2, 3)
            tokens = jax.lax.all_to_all(parts, expert, 0, 0, tiled=False)  # [G, B, s/G, D]
            if et:
                tokens = jax.lax.all_gather(tokens, et, axis=2, tiled=True)
            y = _gelu(tokens @ w_in) @ w_out
            if et:
                y = jax.lax.psum_scatter(y, et, scatter_dimension=2, tiled=True)
            back = jax.lax.all_to_all(y, expert, 0, 0, tiled=False)
            x = x + back.transpose(1, 0, 2, 3).reshape(b, s, D)
        return jnp.mean(x * x)

    return loss


def make_step(layout: FoldedLayout):
    loss_fn = make_loss(layout)
    specs = param_specs(layout)

    def step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        reduced = []
        for name, grad, spec in zip(("col", "row", "in", "out"), grads, specs, strict=True):
            split = {
                a
                for entry in spec
                if entry
                for a in (entry if isinstance(entry, tuple) else (entry,))
            }
            replicated = tuple(a for a in layout.axis_names if a not in split)
            with jax.named_scope(f"grad_reduce/{name}"):
                reduced.append(jax.lax.psum(grad, replicated))
        new_params = tuple(p - LR * g for p, g in zip(params, reduced, strict=True))
        return new_params, jax.lax.psum(loss, layout.axis_names)

    return step


def in_specs(layout: FoldedLayout):
    return (param_specs(layout), P(layout.batch_axes, layout.tensor))


def out_specs(layout: FoldedLayout):
    return (param_specs(layout), P())


def _global_batch(layout: FoldedLayout) -> tuple[int, int, int]:
    return (BATCH * math.prod(2 for _ in layout.batch_axes), SEQ, D)


def args(layout: FoldedLayout):
    mesh = layout.mesh
    rng = np.random.default_rng(0)
    params = tuple(
        put(mesh, jnp.asarray(rng.standard_normal(shape), jnp.float32) * 0.5, spec)
        for shape, spec in zip(param_shapes(layout), param_specs(layout), strict=True)
    )
    x = jnp.asarray(rng.standard_normal(_global_batch(layout)), jnp.float32)
    return params, put(mesh, x, in_specs(layout)[1])


def shapes(layout: FoldedLayout):
    mesh = layout.mesh
    params = tuple(
        sds(mesh, shape, spec)
        for shape, spec in zip(param_shapes(layout), param_specs(layout), strict=True)
    )
    return params, sds(mesh, _global_batch(layout), in_specs(layout)[1])


@functools.cache
def program(layout: FoldedLayout) -> Program:
    return capture(
        make_step(layout),
        *shapes(layout),
        mesh=layout.mesh,
        in_specs=in_specs(layout),
        out_specs=out_specs(layout),
    )
