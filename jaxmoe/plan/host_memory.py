"""A run on CPU devices must fit the host's memory: checked before anything is allocated.

The fake CPU devices of a host share its memory. Before the state is initialised, the
bytes it needs are counted from its shapes alone (``jax.eval_shape``): the parameters,
the optimizer and gradient-sync state, and the gradients of one step (one more copy of
the parameters); and the largest single activation of a step
(:func:`jaxmoe.config.sizes.activation_shapes`). More than the host's physical memory
is refused in one line naming the fields. The other activations come on top, so a run
that passes can still be too large; one that fails cannot run at all.
"""

from __future__ import annotations

import math
import os

import jax

from jaxmoe.config import Config, ConfigError
from jaxmoe.config.sizes import Shape, activation_shapes
from jaxmoe.train.resolved import resolve

SIZE_FIELDS = (
    "model.vocab_size",
    "model.d_model",
    "model.num_layers",
    "model.d_ff",
    "moe.num_experts",
    "moe.d_expert",
)


def host_memory_bytes() -> int:
    """The host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def state_bytes(config: Config) -> int:
    """Bytes of the train state and one step's gradients, over every device."""
    state = resolve(config).state_shapes
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
    gradients = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.params))
    return total + gradients


def largest_activation(config: Config) -> tuple[str, Shape, int]:
    """The largest activation of a step: what it is, its shape and its bytes (float32)."""
    what, shape = max(
        activation_shapes(config.model, config.moe, config.train).items(),
        key=lambda item: math.prod(s for _, s in item[1]),
    )
    return what, shape, 4 * math.prod(size for _, size in shape)


def check_host_memory(config: Config, available: int | None = None) -> None:
    """On the CPU backend, refuse a run whose state or largest activation cannot fit
    ``available`` bytes (default: the host's memory); elsewhere the devices have memory of
    their own (not checked here)."""
    if jax.default_backend() != "cpu":
        return
    available = host_memory_bytes() if available is None else available
    what, shape, activation = largest_activation(config)
    if activation > available:
        values = dict(reversed(shape))
        fields = ", ".join(f"{name}={values[name]}" for name in dict(shape))
        raise ConfigError(
            f"{what} of one step would take {activation / 2**30:.3g} GiB, and this host has "
            f"{available / 2**30:.3g} GiB of memory for its CPU devices ({fields}): make "
            "these fields smaller"
        )
    needed = state_bytes(config)
    if needed + activation > available:
        values = config.to_dict()
        fields = ", ".join(
            f"{name}={values[name.split('.')[0]][name.split('.')[1]]}" for name in SIZE_FIELDS
        )
        raise ConfigError(
            f"the train state needs {needed / 2**30:.3g} GiB (parameters, gradients, "
            f"optimizer state), and this host has {available / 2**30:.3g} GiB of memory for "
            f"its CPU devices ({fields}): make the model smaller"
        )
