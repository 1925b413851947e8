"""The one module that touches JAX internals (``jax._src``) and JAX's conventions.

JAX (0.11.2 to 0.12.x) has asynchronous collective primitives, private to
``jax._src.lax.parallel``: ``<name>_start_p`` binds like the synchronous
collective and returns a future; ``<name>_done_p`` takes the future and
returns the result. They lower to ``stablehlo.async_start``/``async_done`` and
have no differentiation rules, so they are bound only after AD, when the
scheduled program is emitted. Everything else in ``scheduling`` goes through
the functions here, so that another JAX version fails in one place, with a
clear message, or falls back to synchronous collectives.

It also holds the conventions of JAX's jaxprs that capture reads and that a new
JAX version may change: which call-like primitives carry a body to inline, and in
which parameter; where a ``shard_map`` keeps its body and specs; how a remat body
is lowered; and how AD writes its passes into the name stack.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

# The JAX releases whose private primitives this module was checked against: from
# 0.11.2 (the oldest the package accepts) up to, not including, 0.13. Within the range a
# primitive is used only if the release has it (0.12 dropped ``psum_start_p``: a psum whose
# operand varies over the mesh is ``psum_invariant``, which keeps its start).
SUPPORTED_JAX_RANGE = ((0, 11, 2), (0, 13))


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:4])


def jax_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the running JAX) is in :data:`SUPPORTED_JAX_RANGE`."""
    oldest, newest = SUPPORTED_JAX_RANGE
    return oldest <= _release(version or jax.__version__) < newest


def _supported_range_text() -> str:
    oldest, newest = SUPPORTED_JAX_RANGE
    return f">={'.'.join(map(str, oldest))},<{'.'.join(map(str, newest))}"


class AsyncCollectivesUnavailable(RuntimeError):
    """The running JAX has no async collective primitives this module knows."""


def _load_async_primitives() -> dict[str, tuple[Any, Any]]:
    if not jax_supported():
        return {}
    try:
        from jax._src.lax import parallel
    except ImportError:
        return {}
    pairs = {
        "all_to_all": ("all_to_all_start_p", "all_to_all_done_p"),
        "psum": ("psum_start_p", "psum_done_p"),
        "psum_invariant": ("psum_invariant_start_p", "psum_done_p"),
        "ppermute": ("ppermute_start_p", "ppermute_done_p"),
        "all_gather": ("all_gather_start_p", "all_gather_done_p"),
        "reduce_scatter": ("reduce_scatter_start_p", "reduce_scatter_done_p"),
    }
    found = {}
    for name, (start, done) in pairs.items():
        if hasattr(parallel, start) and hasattr(parallel, done):
            found[name] = (getattr(parallel, start), getattr(parallel, done))
    if "psum" not in found and hasattr(parallel, "psum_done_p"):
        found["psum"] = (_psum_start_primitive(parallel), parallel.psum_done_p)
    return found


def _psum_start_primitive(parallel: Any) -> Any:
    """The start of a ``psum`` whose operand's variance is not tracked (``check_vma=False``).

    From jax 0.11.2 the only async all-reduce is ``psum_invariant_start_p``, whose abstract
    evaluation requires the operand to vary over the summed axes. This start has the
    synchronous ``psum``'s abstract evaluation and JAX's own async all-reduce lowering, and
    pairs with ``psum_done_p``: the same HLO as ``psum_invariant_start``, for the steps
    this scheduler captures (traced with ``check_vma=False``).
    """
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lax import lax

    start = core.Primitive("psum_start")

    def abstract_eval(aval: Any, *, axes: tuple, axis_index_groups: Any) -> Any:
        out, effects = parallel.psum_p.abstract_eval(
            aval, axes=axes, axis_index_groups=axis_index_groups
        )
        return core.AbstractFuture(out, parallel.psum_done_p.bind), effects

    start.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(
        start,
        functools.partial(parallel._all_reduce_lowering, lax.add_p, lax.reduce_sum, is_async=True),
    )
    return start


_ASYNC_PRIMITIVES = _load_async_primitives()


def async_collectives_available() -> bool:
    return bool(_ASYNC_PRIMITIVES)


def require_async_collectives() -> None:
    if not async_collectives_available():
        raise AsyncCollectivesUnavailable(
            f"jax {jax.__version__} is not a version whose async collectives this scheduler "
            f"supports ({_supported_range_text()}): install a supported jax, or pass "
            'a policy with transport="sync" to keep the scheduled order with synchronous '
            "collectives"
        )


# XLA:GPU builds known to mishandle scheduling groups (``_scheduling_group_id``), by the
# JAX version they ship with, and how (experiments/results/gpu_schedule_check.md). The
# XLA:GPU of jax 0.10.2 crashed on a group over an all-to-all; that release is below the
# supported range. jax 0.11.2's drops the groups harmlessly; 0.12's is not yet measured.
_XLA_GPU_GROUP_FAILURES: dict[str, str] = {}


def xla_groups_withheld(platform: str) -> str | None:
    """Why the scheduling groups must not be emitted for ``platform`` with this JAX, or
    None where XLA is not known to mishandle them."""
    return _XLA_GPU_GROUP_FAILURES.get(jax.__version__) if platform == "gpu" else None


def can_start_async(primitive_name: str, params: dict[str, Any], num_operands: int) -> bool:
    """Whether this collective equation can be bound as a start/done pair."""
    if primitive_name not in _ASYNC_PRIMITIVES or num_operands != 1:
        return False
    # The async lowering of reduce_scatter exists only for the tiled form.
    if primitive_name == "reduce_scatter" and not params.get("tiled", False):
        return False
    # The async all-reduce lowering sums over named axes, without index groups.
    if primitive_name == "psum":
        axes = params.get("axes", ())
        return params.get("axis_index_groups") is None and not any(
            isinstance(axis, int) for axis in axes
        )
    return True


def bind_start(primitive_name: str, operand: Any, params: dict[str, Any]) -> Any:
    """Start the collective; returns a future for :func:`bind_done`."""
    start, _ = _ASYNC_PRIMITIVES[primitive_name]
    return start.bind(operand, **params)


def bind_done(primitive_name: str, future: Any) -> Any:
    _, done = _ASYNC_PRIMITIVES[primitive_name]
    return done.bind(future)


# How an async collective's halves appear in the lowered StableHLO: from jax 0.11.2, custom
# calls (``@"all-to-all-start"``, ``@"all-reduce-done"``, ...) that XLA turns into its async
# collectives; before, ``stablehlo.async_start``/``async_done`` ops.
_STABLEHLO_HALF = re.compile(
    r'stablehlo\.custom_call @"(?:all-reduce|all-gather|all-to-all|reduce-scatter|'
    r'collective-permute)-(start|done)"'
)


def stablehlo_async_half(line: str) -> str | None:
    """``"start"`` or ``"done"`` where a line of lowered StableHLO is one half of an async
    collective, else None."""
    match = _STABLEHLO_HALF.search(line)
    return None if match is None else match.group(1)


def stablehlo_async_pairs(text: str) -> tuple[int, int]:
    """The numbers of async collective starts and dones in lowered StableHLO text."""
    halves = [stablehlo_async_half(line) for line in text.splitlines()]
    return halves.count("start"), halves.count("done")


def has_ordered_effect(eqn: Any) -> bool:
    """Whether the equation has an effect that fixes its order (e.g. an ordered print).

    Collectives carry ``NamedAxisEffect``s, which are not ordered: they may move.
    """
    if not eqn.effects:
        return False
    from jax._src import effects

    return any(effects.ordered_effects.contains(effect) for effect in eqn.effects)


@contextlib.contextmanager
def traced_as(eqn: Any, name_stack: str) -> Iterator[None]:
    """Bind what follows under ``eqn``'s source location and the name stack ``name_stack``.

    The emitted program then carries the original step's metadata: each HLO
    instruction's ``op_name`` ends in the op's layer and primitive, as when the
    step is compiled as written (``name_stack`` is the op's full stack in the
    captured program; an inlined call's equation knows only its own part).
    """
    from jax._src import source_info_util

    stack = source_info_util.current_name_stack()
    if name_stack:
        stack = stack.extend(name_stack)
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack):
        yield


def bind_equation(eqn: Any, operands: Sequence[Any]) -> list[Any]:
    """Evaluate one jaxpr equation on ``operands`` (tracers), as ``eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        result = eqn.primitive.bind(*operands, **params)
    return list(result) if eqn.primitive.multiple_results else [result]


# -- Conventions of JAX's jaxprs ------------------------------------------------------

# Call-like primitives and the parameter that holds their body. JAX 0.12 calls its
# ``closed_call`` ``eval_jaxpr``: a custom_vjp's forward rule, differentiated, is one.
INLINED_BODIES = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "eval_jaxpr": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}
REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint"})
# Equations that only annotate a value for differentiation: ``checkpoint_name``'s, which
# a checkpoint policy reads. Past differentiation each is its operand (XLA never sees it).
ANNOTATIONS = frozenset({"name"})


def is_annotation(eqn: Any) -> bool:
    """Whether ``eqn`` passes its operand through unchanged, an annotation for autodiff."""
    return eqn.primitive.name in ANNOTATIONS


def inlined_body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a call-like equation to inline, else None."""
    param = INLINED_BODIES.get(eqn.primitive.name)
    if param is None or param not in eqn.params:
        return None
    body = eqn.params[param]
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, body.consts
    return body, ()


def recomputes_behind_a_barrier(eqn: Any) -> bool:
    """A remat body that JAX lowers behind an ``optimization_barrier`` on its inputs."""
    return (
        eqn.primitive.name in REMAT_PRIMITIVES
        and bool(eqn.params.get("prevent_cse"))
        and bool(eqn.params.get("differentiated"))
    )


def carries_subprogram(eqn: Any) -> bool:
    """Whether the equation carries a sub-program (control flow) in its parameters.

    A scatter's ``update_jaxpr`` only combines two scalars; it is not a sub-program.
    """
    return any(
        isinstance(p, jcore.Jaxpr | jcore.ClosedJaxpr)
        or (isinstance(p, tuple) and any(isinstance(q, jcore.ClosedJaxpr) for q in p))
        for name, p in eqn.params.items()
        if name != "update_jaxpr"
    )


def subprograms(eqn: Any) -> list[tuple[Any, float]]:
    """The sub-programs of a control-flow equation, each with how often it runs: a nested
    call's (``jit``, ``eval_jaxpr``, any of :data:`INLINED_BODIES`) once, a ``scan``'s body
    ``length`` times, each branch of a ``cond`` once (the caller takes the costliest), a
    ``while``'s condition and body once each (the trip count is known only when the step
    runs). Empty for any other equation."""
    params, name = eqn.params, eqn.primitive.name
    call = inlined_body(eqn)  # a nested call (capture inlines those of the step itself)
    if call is not None:
        return [(call[0], 1.0)]
    if name == "scan":
        return [(params["jaxpr"].jaxpr, float(params["length"]))]
    if name == "cond":
        return [(branch.jaxpr, 1.0) for branch in params["branches"]]
    if name == "while":
        return [(params["cond_jaxpr"].jaxpr, 1.0), (params["body_jaxpr"].jaxpr, 1.0)]
    return []


def scan_operands(eqn: Any) -> tuple[int, int]:
    """``(consts, carries)``: how many of a ``scan``'s operands are loop invariants and
    how many carries; the rest are scanned. Its body takes them in that order and gives
    the carries, then the stacked results. JAX from 0.12 describes the groups as flat
    trees (``ft_in``); before, as counts."""
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()
    return len(consts), len(carries)


def shard_map_parts(eqn: Any) -> tuple[Any, Sequence[Any], Sequence[Any]]:
    """``(body jaxpr, in_specs, out_specs)`` of a ``shard_map`` equation."""
    if eqn.primitive.name != "shard_map":
        raise ValueError(
            f"expected a shard_map equation, found {eqn.primitive.name!r}: capture expects "
            "the traced step to be exactly one whole-mesh shard_map"
        )
    return eqn.params["jaxpr"], eqn.params["in_specs"], eqn.params["out_specs"]


def ad_pass(name_stack: str) -> str | None:
    """Which pass of AD an equation of ``name_stack`` belongs to: ``"backward"`` (inside
    ``transpose(...)``), ``"forward"`` (inside ``jvp(...)``), or None (outside AD)."""
    if "transpose(" in name_stack:
        return "backward"
    if "jvp(" in name_stack:
        return "forward"
    return None


@functools.lru_cache(maxsize=1 << 16)
def without_transforms(name_stack: str) -> str:
    """The name stack without AD transforms: ``transpose(jvp(layer_1))/moe`` becomes
    ``layer_1/moe``."""
    stripped = re.sub(r"[A-Za-z_]\w*\(", "", name_stack).replace(")", "")
    return "/".join(part for part in stripped.split("/") if part)


# -- host callbacks that take their operands as NumPy arrays ---------------------------------
#
# ``jax.experimental.io_callback`` first puts its operands on the process's first CPU device
# (``io_callback_impl``: ``device_put``), and reading one (``np.asarray``) waits for that copy,
# which XLA:CPU makes on the client's thread pool when the operand has 100 KiB or more. With
# one device per process, the program and its callbacks run on the Python thread that called
# it. With several, each device's program runs on a worker of that same pool, and the
# callback, blocking that worker, waits for a copy queued from it: in a process with two
# devices, about half the runs hang there for good, every other worker of the pool idle.
# ``host_callback`` emits the same custom call, but hands the host function the NumPy arrays
# that XLA passes to the callback, placed on no device: there is no copy to wait for.


@functools.cache
def _host_callback_primitive() -> Any | None:
    if not jax_supported():
        return None
    try:
        from jax._src import callback, core, dispatch
        from jax._src.interpreters import mlir
    except ImportError:
        return None
    primitive = core.Primitive("host_callback")
    primitive.multiple_results = True
    dispatch.prim_requires_devices_during_lowering.add(primitive)
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))

    def abstract_eval(*avals: Any, host_function: Any, result_avals: tuple) -> Any:
        return result_avals, {callback._IOEffect}

    def lowering(ctx: Any, *operands: Any, host_function: Any, result_avals: tuple) -> Any:
        sharding = callback._callback_op_sharding(
            ctx.module_context.axis_context, None, ctx.avals_out
        )
        results, _, _ = callback.emit_python_callback(
            ctx,
            host_function,
            None,
            list(operands),
            ctx.avals_in,
            ctx.avals_out,
            has_side_effect=True,
            returns_token=False,
            sharding=sharding,
        )
        return results

    primitive.def_effectful_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, lowering, cacheable=False)
    return primitive


def host_callback_available() -> bool:
    """Whether :func:`host_callback` skips the device copy (else it is ``io_callback``)."""
    return _host_callback_primitive() is not None


HOST_CALLBACK_NAMES = ("host_callback", "io_callback")  # the primitive's name, either way


def host_callback(function: Any, result_shapes: Any, *args: Any) -> Any:
    """``jax.experimental.io_callback(function, result_shapes, *args)`` (unordered), whose
    ``function`` gets NumPy arrays that are on no device (see above).

    It may block, also with several devices per process, as long as what it waits for does
    not need XLA's threads. Without the primitive (another JAX), it is ``io_callback``.
    """
    primitive = _host_callback_primitive()
    if primitive is None:
        from jax.experimental import io_callback

        return io_callback(function, result_shapes, *args)
    flat_args, in_tree = jax.tree.flatten(args)
    flat_shapes, out_tree = jax.tree.flatten(result_shapes)
    result_avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in flat_shapes)

    def host_function(*flat: Any) -> tuple:
        return tuple(jax.tree.leaves(function(*jax.tree.unflatten(in_tree, flat))))

    results = primitive.bind(*flat_args, host_function=host_function, result_avals=result_avals)
    return jax.tree.unflatten(out_tree, results)
