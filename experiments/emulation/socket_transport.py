"""The emulated cluster's transport: all-to-alls that overlap computation on the CPU
backend, as host callbacks over TCP, plugged into the scheduling layer.

XLA:CPU compiles every async collective start/done pair back to a synchronous
collective, so on CPU hosts a scheduled step cannot hide its communication. This module
gives the all-to-all a start and a done of its own, each a host callback
(``scheduling.host_callback``, an ``io_callback`` whose operands stay NumPy arrays):

- the start hands the device's pieces to a background thread per peer process, which
  sends them over one TCP connection per pair of processes (pieces for devices of the
  same process are handed over in memory), and returns at once with a zero token;
- the done waits until every piece for this device has arrived and returns them
  concatenated, as ``lax.all_to_all`` (tiled) would: pure data movement, bit for bit.

A *trimmed* start (``trim``: the static form of a ragged exchange, pieces ``[1, rows,
...]`` of an operand split along axis 0 whose rows past the routed ones are zeros) sends
each piece only up to its last row with a non-zero byte; the done pads the rows it did
not get with zeros, which is what they were, so the result is the same bit for bit and
only the routed rows travel. ``SocketTransport.traffic`` counts the bytes of the pieces
sent and what they would have been whole, to other processes and within one.

The order is kept by data dependence, not by the compiler's scheduler: the computation
meant to run during the transfer consumes the start's token (``consume_token``, an exact
``x - 0.0``), and the done takes a value of that computation as an operand (``after``).
A done therefore cannot run before the computation, nor the computation before the start.

With several devices per process, each device's program runs on its own thread of
XLA's pool, so a done may block its thread while the other devices of the process go
on to their starts. The callbacks must not wait for anything that needs XLA's threads,
which is why their operands are not placed on a device (``jax.experimental.io_callback``
would copy them there, and with several devices per process reading them could hang).

Every device of every process takes part; the processes find each other through the JAX
distributed runtime (``multihost_utils.process_allgather`` of each one's address and port),
so ``SocketTransport.connect`` must be called by all processes, after
``jax.distributed.initialize``. Pieces are matched by (key, source, destination) in
arrival order, so each key must be started once per step on every device, in the same order.
Use it only where the backend is CPU and the step spans processes; elsewhere XLA's own
collectives are the better choice.

The start's callback runs under the name scope ``socket_start`` and the done's under
``socket_done`` (:data:`START_SCOPE`, :data:`DONE_SCOPE`), inside the all-to-all's own name
stack: a profiler trace of the step then tells each callback's time
(``scheduling.traced_costs`` reads it as the collective's host work, given
:data:`CALLBACK_SCOPES`).

A done fails, in one line, rather than wait forever: when a process whose piece it
lacks has closed its connection (it exited or was killed) or the connection broke, when
another done of this process failed, when the transport was closed or aborted, or when
its pieces are later than the bound (``SocketTransport.receive_bound_s``: the time for
peers to reach their start plus a generous transfer time at the link's rate).
"""

from __future__ import annotations

import collections
import contextlib
import math
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from scheduling import (
    ExperimentalOptions,
    Op,
    Transport,
    connect_transport,
    host_callback,
    host_callback_available,
    is_ragged_exchange,
)

_HEADER = struct.Struct("!qiiq")  # key, source position, destination position, payload bytes
_HELLO = struct.Struct("!i")  # the connecting process's index
DEFAULT_LINK_MBIT = 100.0  # the link rate a transport assumes when it is not told
DEFAULT_WAIT_S = 60.0  # how long a done allows the peers to reach their start
_TRANSFER_MARGIN = 4.0  # the bound allows this many times the transfer at the link rate
_CLOSE_WAIT_S = 10.0  # how long ``close`` lets the sender threads finish
START_SCOPE, DONE_SCOPE = "socket_start", "socket_done"  # name scopes of the two callbacks
CALLBACK_SCOPES = (START_SCOPE, DONE_SCOPE)


class _Mailbox:
    """Pieces that arrived, by (key, source, destination), each a FIFO of raw bytes; and why
    pieces will not come: a peer process whose connection ended, or a failure of them all."""

    def __init__(self) -> None:
        self._pieces: dict[tuple[int, int, int], collections.deque[bytes]] = (
            collections.defaultdict(collections.deque)
        )
        self._changed = threading.Condition()
        self._ended: dict[int, str] = {}  # peer process -> why its pieces stopped
        self.failure: str | None = None  # set: every piece still missing fails at once

    def put(self, key: tuple[int, int, int], payload: bytes) -> None:
        with self._changed:
            self._pieces[key].append(payload)
            self._changed.notify_all()

    def end(self, process: int, reason: str) -> None:
        """No more pieces will come from ``process``."""
        with self._changed:
            self._ended.setdefault(process, reason)
            self._changed.notify_all()

    def fail(self, reason: str) -> None:
        """No piece still missing will come (the first reason is kept)."""
        with self._changed:
            if self.failure is None:
                self.failure = reason
            self._changed.notify_all()

    def take(self, key: tuple[int, int, int], process: int, deadline: float) -> bytes:
        """The next piece under ``key``, which ``process`` sends; waits until ``deadline``
        (``time.monotonic()``). Raises ``ConnectionError`` if it will not come, or
        ``TimeoutError`` (the message is completed by the caller)."""
        with self._changed:
            while True:
                if self._pieces[key]:
                    return self._pieces[key].popleft()
                if process in self._ended:
                    raise ConnectionError(self._ended[process])
                if self.failure is not None:
                    raise ConnectionError(self.failure)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._changed.wait(left)


def _receive_exactly(connection: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None if the peer closed before the first one."""
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = connection.recv_into(view[received:])
        if not count:
            if received == 0:
                return None
            raise ConnectionError(f"closed {size - received} bytes short of a {size}-byte read")
        received += count
    return bytes(buffer)


class SocketTransport:
    """This process's TCP connections to every other process of the run, and its mailbox.

    ``link_mbit`` (the rate of the link between processes; default ``DEFAULT_LINK_MBIT``)
    and ``wait_s`` (how long a done allows its peers to reach their start: their skew,
    a first step's compilation) set how long a done waits (``receive_bound_s``).

    ``traffic`` (one per process, over every transport it made): bytes of the pieces
    sent, ``remote`` (to other processes) and ``local`` (handed over in memory), and
    ``remote_whole``/``local_whole``, what they would have been untrimmed.
    """

    traffic: ClassVar[collections.Counter] = collections.Counter()
    _traffic_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        mesh: Mesh,
        connections: dict[int, socket.socket],
        *,
        link_mbit: float | None = None,
        wait_s: float = DEFAULT_WAIT_S,
    ):
        self.mesh = mesh
        self.process = jax.process_index()
        self.mailbox = _Mailbox()
        self.link_mbit = DEFAULT_LINK_MBIT if link_mbit is None else float(link_mbit)
        self.wait_s = float(wait_s)
        if self.link_mbit <= 0 or self.wait_s < 0:
            raise ValueError(f"link_mbit {link_mbit} must be > 0 and wait_s {wait_s} >= 0")
        self.position_process = [device.process_index for device in mesh.devices.flat]
        self.local_devices = self.position_process.count(self.process)
        self._outboxes: dict[int, queue.Queue] = {}
        self._senders: list[threading.Thread] = []
        self._connections = connections
        self._closing = False
        for peer, connection in connections.items():
            outbox: queue.Queue = queue.Queue()
            self._outboxes[peer] = outbox
            for target in (self._send_loop, self._receive_loop):
                thread = threading.Thread(
                    target=target, args=(peer, connection, outbox), daemon=True, name=f"a2a-{peer}"
                )
                thread.start()
                if target == self._send_loop:
                    self._senders.append(thread)

    @classmethod
    def connect(
        cls,
        mesh: Mesh,
        address: str | None = None,
        *,
        link_mbit: float | None = None,
        wait_s: float = DEFAULT_WAIT_S,
    ) -> SocketTransport:
        """Connect every pair of processes of ``mesh``; call in all processes at once.

        ``address`` is where this process listens (default: what its host name resolves
        to, as for gloo). ``link_mbit`` and ``wait_s``: see the class.
        """
        address = address or socket.gethostbyname(socket.gethostname())
        server = socket.create_server((address, 0))
        port = server.getsockname()[1]
        packed = socket.inet_aton(address)
        mine = np.array([*packed, port // 256, port % 256], np.int32)
        everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 6)
        me, connections = jax.process_index(), {}
        for peer in range(me + 1, len(everyone)):  # connect upward, accept from below
            peer_address = socket.inet_ntoa(bytes(int(b) for b in everyone[peer, :4]))
            peer_port = int(everyone[peer, 4]) * 256 + int(everyone[peer, 5])
            connection = socket.create_connection((peer_address, peer_port), timeout=60)
            connection.sendall(_HELLO.pack(me))
            connections[peer] = connection
        server.settimeout(60)
        for _ in range(me):
            connection, _ = server.accept()
            hello = _receive_exactly(connection, _HELLO.size)
            if hello is None:
                raise ConnectionError("socket all_to_all: a peer closed before saying who it is")
            (peer,) = _HELLO.unpack(hello)
            connections[peer] = connection
        server.close()
        for connection in connections.values():
            connection.settimeout(None)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(mesh, connections, link_mbit=link_mbit, wait_s=wait_s)

    def receive_bound_s(self, remote_bytes: int) -> float:
        """How long a done waits when this process is to receive ``remote_bytes`` from
        other processes in its exchange: ``wait_s``, plus ``_TRANSFER_MARGIN`` times the
        transfer at ``link_mbit``."""
        return self.wait_s + _TRANSFER_MARGIN * remote_bytes * 8 / (self.link_mbit * 1e6)

    def send(
        self, key: int, source: int, destination: int, piece: np.ndarray, trim: bool = False
    ) -> None:
        """Deliver ``piece`` from mesh position ``source`` to ``destination`` (returns at once);
        ``trim``: only its rows (axis 1) up to the last with a non-zero byte."""
        piece = np.ascontiguousarray(piece)
        whole = piece.nbytes
        if trim:
            piece = piece[:, : _rows_in_use(piece)]
        payload = piece.tobytes()
        process = self.position_process[destination]
        where = "local" if process == self.process else "remote"
        with self._traffic_lock:
            SocketTransport.traffic[where] += len(payload)
            SocketTransport.traffic[f"{where}_whole"] += whole
        if process == self.process:
            self.mailbox.put((key, source, destination), payload)
        else:
            self._outboxes[process].put(
                (_HEADER.pack(key, source, destination, len(payload)), payload)
            )

    def take(self, key: int, source: int, destination: int, deadline: float) -> bytes:
        """The piece ``send`` delivered from ``source`` to ``destination`` under ``key``;
        waits until ``deadline`` (``time.monotonic()``)."""
        process = self.position_process[source]
        return self.mailbox.take((key, source, destination), process, deadline)

    def _send_loop(self, peer: int, connection: socket.socket, outbox: queue.Queue) -> None:
        while (item := outbox.get()) is not None:
            header, payload = item
            try:
                connection.sendall(header)
                connection.sendall(payload)
            except OSError as error:
                self.mailbox.fail(f"sending to process {peer} failed ({error}): it probably died")
                return

    def _receive_loop(self, peer: int, connection: socket.socket, outbox: queue.Queue) -> None:
        try:
            while (header := _receive_exactly(connection, _HEADER.size)) is not None:
                key, source, destination, size = _HEADER.unpack(header)
                payload = _receive_exactly(connection, size)
                if payload is None:
                    raise ConnectionError(f"closed before a {size}-byte piece")
                self.mailbox.put((key, source, destination), payload)
            if not self._closing:
                self.mailbox.end(
                    peer, f"process {peer} closed its connection (it ended or was killed)"
                )
        except (OSError, ConnectionError) as error:
            if not self._closing:
                self.mailbox.end(
                    peer, f"the connection to process {peer} broke ({error}): it probably died"
                )

    def abort(self, reason: str) -> None:
        """Make every done that waits, or will wait, for a piece fail at once with ``reason``."""
        self.mailbox.fail(reason)

    def close(self) -> None:
        """Send what is queued, then close the connections (each peer sees its end)."""
        self._closing = True
        for outbox in self._outboxes.values():
            outbox.put(None)
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for thread in self._senders:
            thread.join(max(0.0, deadline - time.monotonic()))
        for connection in self._connections.values():
            with contextlib.suppress(OSError):  # the peer may have closed first
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self.mailbox.fail("the socket transport was closed")


def _rows_in_use(piece: np.ndarray) -> int:
    """Rows (axis 1) of ``piece`` up to the last with a non-zero byte (0 if all are zero)."""
    if piece.ndim < 2 or not piece.size:
        return piece.shape[1] if piece.ndim >= 2 else 0
    rows = np.moveaxis(piece, 1, 0).reshape(piece.shape[1], -1).view(np.uint8)
    used = np.flatnonzero(rows.any(axis=1))
    return int(used[-1]) + 1 if used.size else 0


def _padded(payload: bytes, dtype: np.dtype, piece_shape: tuple[int, ...]) -> np.ndarray:
    """A piece from its payload: whole, or its first rows (axis 1) followed by zero rows."""
    whole = math.prod(piece_shape) * dtype.itemsize
    values = np.frombuffer(payload, dtype)
    if len(payload) == whole:
        return values.reshape(piece_shape)
    row = (piece_shape[0], 1, *piece_shape[2:])
    rows = values.size // math.prod(row)
    piece = np.zeros(piece_shape, dtype)
    piece[:, :rows] = values.reshape(piece_shape[0], rows, *piece_shape[2:])
    return piece


def consume_token(x: jax.Array, token: jax.Array) -> jax.Array:
    """``x`` made to depend on a start's token, exactly (``x - 0.0`` keeps every bit, -0.0 too)."""
    return x - token.astype(x.dtype)


class SocketAllToAll:
    """``lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)`` as a start and a
    done, for use inside a ``shard_map`` over ``transport.mesh`` with every axis manual."""

    def __init__(self, transport: SocketTransport, axis_name: str):
        mesh = transport.mesh
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}"
            )
        self.transport = transport
        self.axis_name = axis_name
        self.axis = mesh.axis_names.index(axis_name)
        self.axis_size = mesh.devices.shape[self.axis]
        self._shape = mesh.devices.shape
        if transport.local_devices > 1 and not host_callback_available():
            raise ValueError(
                f"socket all_to_all: with jax {jax.__version__}, only one device per process "
                f"(this one has {transport.local_devices}): its host callbacks could hang"
            )

    def _position(self) -> jax.Array:
        """This device's linear (C-order) position in the mesh, traced."""
        position = jnp.int32(0)
        for name, size in zip(self.transport.mesh.axis_names, self._shape, strict=True):
            position = position * size + jax.lax.axis_index(name)
        return position

    def _peer(self, position: int, index: int) -> int:
        """The position of the device at ``index`` along the axis, in ``position``'s group."""
        coordinates = list(np.unravel_index(position, self._shape))
        coordinates[self.axis] = index
        return int(np.ravel_multi_index(coordinates, self._shape))

    def start(self, x: jax.Array, *, key: int, split_axis: int, trim: bool = False) -> jax.Array:
        """Send this device's pieces of ``x``; returns a float32 zero token at once.

        ``trim`` (a ragged exchange's pieces, ``split_axis`` 0): each piece only up to its
        last row with a non-zero byte (see the module docstring)."""
        if x.shape[split_axis] % self.axis_size:
            raise ValueError(
                f"split_axis {split_axis} of shape {x.shape} does not divide into "
                f"{self.axis_size} pieces"
            )
        trim = trim and split_axis == 0 and x.ndim >= 2

        def host_start(position: np.ndarray, value: np.ndarray) -> np.ndarray:
            position = int(position)
            for index, piece in enumerate(np.split(value, self.axis_size, axis=split_axis)):
                self.transport.send(key, position, self._peer(position, index), piece, trim)
            return np.float32(0)

        position = self._position()
        with jax.named_scope(START_SCOPE):
            return host_callback(host_start, jax.ShapeDtypeStruct((), jnp.float32), position, x)

    def done(
        self,
        token: jax.Array,
        after: jax.Array,
        *,
        key: int,
        like: jax.ShapeDtypeStruct | jax.Array,
        split_axis: int,
        concat_axis: int,
        release_token: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Wait for this device's pieces (once ``after`` is computed) and return them joined.

        ``like`` is the operand of the start (its shape and dtype). With ``release_token``,
        also returns a float32 zero token made once the pieces are in: computation that
        consumes it (``consume_token``) cannot run while the done waits.
        """
        shape = list(like.shape)
        shape[split_axis] //= self.axis_size
        piece_shape, dtype = tuple(shape), np.dtype(like.dtype)
        shape[concat_axis] *= self.axis_size
        result = jax.ShapeDtypeStruct(tuple(shape), like.dtype)

        transport = self.transport
        piece_bytes = math.prod(piece_shape) * dtype.itemsize

        def host_done(position: np.ndarray, _token: np.ndarray, _after: np.ndarray) -> Any:
            position = int(position)
            sources = [self._peer(position, index) for index in range(self.axis_size)]
            remote = sum(transport.position_process[s] != transport.process for s in sources)
            # Every local device receives as much at once, over the same link.
            bound = transport.receive_bound_s(remote * piece_bytes * transport.local_devices)
            deadline = time.monotonic() + bound
            pieces = []
            for source in sources:
                try:
                    payload = transport.take(key, source, position, deadline)
                except (ConnectionError, TimeoutError) as error:
                    cause = str(error) or self._late(source, bound)
                    message = f"socket all_to_all {key} at mesh position {position}: {cause}"
                    # The step is lost: the other dones of this process give up too.
                    transport.abort(f"another all-to-all of this process failed ({message})")
                    raise type(error)(message) from None
                pieces.append(_padded(payload, dtype, piece_shape))
            joined = np.concatenate(pieces, axis=concat_axis)
            return (joined, np.float32(0)) if release_token else joined

        shapes = (result, jax.ShapeDtypeStruct((), jnp.float32)) if release_token else result
        position = self._position()
        with jax.named_scope(DONE_SCOPE):
            return host_callback(host_done, shapes, position, token, _scalar(after))

    def _late(self, source: int, bound: float) -> str:
        transport = self.transport
        return (
            f"the piece from mesh position {source} (process "
            f"{transport.position_process[source]}) did not arrive within {bound:.3g} s "
            f"(wait_s {transport.wait_s:g} s + {_TRANSFER_MARGIN:g}x the transfer at "
            f"link_mbit {transport.link_mbit:g}): that process is stuck or far behind"
        )


def _scalar(x: jax.Array) -> jax.Array:
    """One element of ``x``: enough for a data dependence, nothing to copy to the host."""
    return jnp.ravel(x)[0] if math.prod(x.shape) else jnp.zeros((), x.dtype)


def all_to_all_now(
    op: SocketAllToAll, x: jax.Array, *, key: int, split_axis: int, concat_axis: int
) -> jax.Array:
    """Start and done back to back: the synchronous all-to-all over sockets."""
    token = op.start(x, key=key, split_axis=split_axis)
    return op.done(token, token, key=key, like=x, split_axis=split_axis, concat_axis=concat_axis)


def _is_float(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


class EmittedOrder:
    """Socket all-to-alls in an emitted program, its order pinned by data dependence.

    The emitter (``scheduling.emit``) walks the scheduled order and calls ``start`` and
    ``done`` for each all-to-all pair this supports, ``pin`` on the inputs of every other
    op and ``record`` after it. The matmuls (``dot_general``), the bulk of the work, are
    the anchors that keep the scheduled order:

    - a matmul after a start consumes that start's token (exactly, on its last floating
      operand), unless one of its inputs already comes after it; a start's operand is
      pinned the same way, so the latest token orders an op after every earlier start;
    - a done takes a running scalar of the first operand of every matmul recorded before
      it, so it waits until all the matmuls scheduled before it can run.

    Only matmuls, and those operands, are touched because each extra consumer can change
    how XLA fuses the producer, and with it the rounding: pinning every op, or reading
    every op's output, changed gradients by an ulp; this rule keeps the scheduled steps bit
    for bit (tests/train/test_socket_schedule.py checks it).
    """

    def __init__(self, transport: SocketTransport):
        self.transport = transport
        self._ops: dict[str, SocketAllToAll] = {}
        self._pending: dict[int, tuple[SocketAllToAll, jax.Array, Any, dict]] = {}
        self._token: jax.Array | None = None
        self._starts = 0  # starts so far; an op's inputs carry the count they come after
        # id(traced value) -> (starts it comes after, the value)
        self._after_starts: dict[int, tuple[int, Any]] = {}
        self._pinned_after = 0
        self._progress: jax.Array | None = None

    def supports(
        self, primitive: str, params: dict, operand: Any, result_shape: Sequence[int]
    ) -> bool:
        """An all-to-all over one mesh axis whose result is the tiled one (the step's are)."""
        if primitive != "all_to_all" or params.get("axis_index_groups") is not None:
            return False
        axis = params["axis_name"]
        axis = axis[0] if isinstance(axis, tuple) and len(axis) == 1 else axis
        if axis not in self.transport.mesh.axis_names:
            return False
        size = self.transport.mesh.shape[axis]
        shape = list(operand.shape)
        if shape[params["split_axis"]] % size:
            return False
        shape[params["split_axis"]] //= size
        shape[params["concat_axis"]] *= size
        return tuple(shape) == tuple(result_shape)

    def _comes_after(self, x: Any) -> int:
        return self._after_starts.get(id(x), (0, None))[0]

    def _note(self, value: Any, starts: int) -> None:
        # The value is kept alive with its count, so that its id is not reused.
        self._after_starts[id(value)] = (starts, value)

    def pin(self, primitive: str, inputs: list[Any]) -> list[Any]:
        """``inputs`` with the latest start's token consumed where the op needs it; the
        op's outputs are then to be passed to ``record``."""
        after = max(map(self._comes_after, inputs), default=0)
        self._pinned_operand = None
        if primitive != "dot_general":
            self._pinned_after = after
            return inputs
        self._pinned_operand = next(
            (v for v in inputs if isinstance(v, jax.Array) and _is_float(v) and v.size), None
        )
        if self._token is not None and after < self._starts:
            for index, value in reversed(list(enumerate(inputs))):
                if isinstance(value, jax.Array) and _is_float(value):
                    inputs = list(inputs)
                    inputs[index] = consume_token(value, self._token)
                    after = self._starts
                    break
        self._pinned_after = after
        return inputs

    def record(self, outputs: Sequence[Any]) -> None:
        """Note what the outputs of the op just pinned come after, and add one of their
        scalars to the progress that the next done waits for."""
        for output in outputs:
            self._note(output, self._pinned_after)
        if self._pinned_operand is not None:
            scalar = _scalar(self._pinned_operand).astype(jnp.float32)
            self._progress = scalar if self._progress is None else self._progress + scalar

    def start(self, node: int, operand: jax.Array, params: dict, trim: bool = False) -> None:
        axis = params["axis_name"]
        axis = axis[0] if isinstance(axis, tuple) else axis
        op = self._ops.setdefault(axis, SocketAllToAll(self.transport, axis))
        (operand,) = self.pin("dot_general", [operand])
        token = op.start(operand, key=node, split_axis=params["split_axis"], trim=trim)
        self._pending[node] = (
            op,
            token,
            jax.ShapeDtypeStruct(operand.shape, operand.dtype),
            params,
        )
        self._starts += 1
        self._token = token

    def now(self, node: int, operand: jax.Array, params: dict, trim: bool = False) -> jax.Array:
        """The all-to-all run synchronously: its start, then its done at once. The done
        waits for every matmul recorded before it, and releases a token that every later
        matmul consumes (unless it already uses the result), so no scheduled matmul runs
        while the pieces travel: the same transport as the scheduled pairs, no overlap."""
        self.start(node, operand, params, trim)
        result, released = self._finish(node, release_token=True)
        self._starts += 1  # what runs after this point must come after the done
        self._token = released
        self._note(result, self._starts)
        return result

    def is_pending(self, node: int) -> bool:
        return node in self._pending

    def done(self, node: int) -> jax.Array:
        result = self._finish(node)
        self._note(result, self._starts)
        return result

    def _finish(self, node: int, **done_options):
        """The done of ``node``'s pending all-to-all, after every matmul recorded so far."""
        op, token, like, params = self._pending.pop(node)
        after = token if self._progress is None else self._progress + token
        return op.done(
            token,
            after,
            key=node,
            like=like,
            split_axis=params["split_axis"],
            concat_axis=params["concat_axis"],
            **done_options,
        )


class SocketAllToAlls:
    """A :class:`scheduling.Transport`: all-to-alls over the sockets of ``connection``,
    every other collective through ``others``. Every op's inputs are pinned after the
    starts the schedule puts before it. An all-to-all the schedule left whole (``none``)
    runs on the sockets too, its done right after its start, so that every schedule is
    measured on one transport; the pieces of a ragged exchange (an ``all_to_all`` under a
    ``ragged_rows`` scope) are sent trimmed to their routed rows."""

    def __init__(self, connection: SocketTransport, others: Transport):
        self._sockets = EmittedOrder(connection)
        self._others = others

    def _carries(self, op: Op, operand: Any) -> bool:
        return self._sockets.supports(
            op.primitive, op.eqn.params, operand, op.outputs[0].aval.shape
        )

    def start(self, node: int, op: Op, operand: Any) -> None:
        if self._carries(op, operand):
            self._sockets.start(node, operand, op.eqn.params, is_ragged_exchange(op))
        else:
            self._others.start(node, op, operand)

    def done(self, start: int, op: Op) -> list[Any]:
        if self._sockets.is_pending(start):
            return [self._sockets.done(start)]
        return self._others.done(start, op)

    def run(self, node: int, op: Op, inputs: list[Any]) -> list[Any]:
        if op.primitive == "all_to_all" and len(inputs) == 1 and self._carries(op, inputs[0]):
            # An all-to-all the schedule left whole (schedule "none"): synchronous, on sockets.
            return [self._sockets.now(node, inputs[0], op.eqn.params, is_ragged_exchange(op))]
        results = self._others.run(node, op, self._sockets.pin(op.primitive, inputs))
        self._sockets.record(results)
        return results


def socket_applies() -> bool:
    """Whether socket all-to-alls help here: the CPU backend, more than one process."""
    return jax.default_backend() == "cpu" and jax.process_count() > 1


def socket_all_to_alls(link_mbit: float | None = None):
    """The connector (``scheduling.ExperimentalOptions.transport``) of socket all-to-alls:
    called with the mesh by every process of the run, it connects them all and returns
    the factory of :class:`SocketAllToAlls`; where sockets do not apply (another backend
    than CPU, one process) the factory of XLA's collectives. ``link_mbit``: the link's
    rate between processes, which bounds how long a socket done waits (default: the
    transport's)."""

    def connect(mesh: Mesh):
        xla = connect_transport("xla", mesh)  # the collectives the sockets do not carry
        if not socket_applies():
            return xla
        connection = SocketTransport.connect(mesh, link_mbit=link_mbit)
        return lambda: SocketAllToAlls(connection, xla())

    return connect


def over_sockets(link_mbit: float | None = None, **options: Any) -> ExperimentalOptions:
    """Experimental options that run the step's all-to-alls over sockets (``options``: any
    other experimental option)."""
    return ExperimentalOptions(transport=socket_all_to_alls(link_mbit), **options)
