"""An all-to-all that overlaps computation on the CPU backend: host callbacks over TCP.

XLA:CPU compiles every async collective start/done pair back to a synchronous
collective, so on CPU hosts a scheduled step cannot hide its communication. This module
gives the all-to-all a start and a done of its own, each a ``jax.experimental.io_callback``:

- the start hands the device's pieces to a background thread per peer process, which
  sends them over one TCP connection per pair of processes (pieces for devices of the
  same process are handed over in memory), and returns at once with a zero token;
- the done waits until every piece for this device has arrived and returns them
  concatenated, as ``lax.all_to_all`` (tiled) would: pure data movement, bit for bit.

The order is kept by data dependence, not by the compiler's scheduler: the computation
meant to run during the transfer consumes the start's token (``consume_token``, an exact
``x - 0.0``), and the done takes a value of that computation as an operand (``after``).
A done therefore cannot run before the computation, nor the computation before the start.

Every device of every process takes part; the processes find each other through the JAX
distributed runtime (``multihost_utils.process_allgather`` of each one's address and port),
so ``SocketTransport.connect`` must be called by all processes, after
``jax.distributed.initialize``. Pieces are matched by (key, source, destination) in
arrival order, so each key must be started once per step on every device, in the same order.
Use it only where the backend is CPU and the step spans processes; elsewhere XLA's own
collectives are the better choice.
"""

from __future__ import annotations

import collections
import contextlib
import math
import queue
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback, multihost_utils
from jax.sharding import Mesh

_HEADER = struct.Struct("!qiiq")  # key, source position, destination position, payload bytes
_HELLO = struct.Struct("!i")  # the connecting process's index
_RECEIVE_TIMEOUT_S = 600.0


class _Mailbox:
    """Pieces that arrived, by (key, source, destination), each a FIFO of raw bytes."""

    def __init__(self) -> None:
        self._pieces: dict[tuple[int, int, int], collections.deque[bytes]] = (
            collections.defaultdict(collections.deque)
        )
        self._arrived = threading.Condition()
        self.failure: BaseException | None = None

    def put(self, key: tuple[int, int, int], payload: bytes) -> None:
        with self._arrived:
            self._pieces[key].append(payload)
            self._arrived.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._arrived:
            self.failure = error
            self._arrived.notify_all()

    def take(self, key: tuple[int, int, int]) -> bytes:
        with self._arrived:
            ready = self._arrived.wait_for(
                lambda: self._pieces[key] or self.failure is not None, _RECEIVE_TIMEOUT_S
            )
            if self._pieces[key]:
                return self._pieces[key].popleft()
            if self.failure is not None:
                raise RuntimeError(f"socket all_to_all: a connection failed: {self.failure}")
            assert not ready
            raise TimeoutError(f"socket all_to_all: piece {key} did not arrive")


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = connection.recv_into(view[received:])
        if not count:
            raise ConnectionError(f"peer closed with {size - received} of {size} bytes unread")
        received += count
    return bytes(buffer)


class SocketTransport:
    """This process's TCP connections to every other process of the run, and its mailbox."""

    def __init__(self, mesh: Mesh, connections: dict[int, socket.socket]):
        self.mesh = mesh
        self.process = jax.process_index()
        self.mailbox = _Mailbox()
        self._position_process = [device.process_index for device in mesh.devices.flat]
        self._outboxes: dict[int, queue.Queue] = {}
        self._threads: list[threading.Thread] = []
        self._connections = connections
        for peer, connection in connections.items():
            outbox: queue.Queue = queue.Queue()
            self._outboxes[peer] = outbox
            for target in (self._send_loop, self._receive_loop):
                thread = threading.Thread(
                    target=target, args=(connection, outbox), daemon=True, name=f"a2a-{peer}"
                )
                thread.start()
                self._threads.append(thread)

    @classmethod
    def connect(cls, mesh: Mesh, address: str | None = None) -> SocketTransport:
        """Connect every pair of processes of ``mesh``; call in all processes at once.

        ``address`` is where this process listens (default: what its host name resolves
        to, as for gloo).
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
            (peer,) = _HELLO.unpack(_receive_exactly(connection, _HELLO.size))
            connections[peer] = connection
        server.close()
        for connection in connections.values():
            connection.settimeout(None)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(mesh, connections)

    def send(self, key: int, source: int, destination: int, piece: np.ndarray) -> None:
        """Deliver ``piece`` from mesh position ``source`` to ``destination`` (returns at once)."""
        payload = np.ascontiguousarray(piece).tobytes()
        process = self._position_process[destination]
        if process == self.process:
            self.mailbox.put((key, source, destination), payload)
        else:
            self._outboxes[process].put(
                (_HEADER.pack(key, source, destination, len(payload)), payload)
            )

    def _send_loop(self, connection: socket.socket, outbox: queue.Queue) -> None:
        while (item := outbox.get()) is not None:
            header, payload = item
            try:
                connection.sendall(header)
                connection.sendall(payload)
            except OSError as error:
                self.mailbox.fail(error)
                return

    def _receive_loop(self, connection: socket.socket, outbox: queue.Queue) -> None:
        try:
            while True:
                header = _receive_exactly(connection, _HEADER.size)
                key, source, destination, size = _HEADER.unpack(header)
                self.mailbox.put((key, source, destination), _receive_exactly(connection, size))
        except (OSError, ConnectionError) as error:
            self.mailbox.fail(error)

    def close(self) -> None:
        """Stop the sender threads and close the connections."""
        for outbox in self._outboxes.values():
            outbox.put(None)
        for connection in self._connections.values():
            with contextlib.suppress(OSError):  # the peer may have closed first
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()


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

    def start(self, x: jax.Array, *, key: int, split_axis: int) -> jax.Array:
        """Send this device's pieces of ``x``; returns a float32 zero token at once."""
        if x.shape[split_axis] % self.axis_size:
            raise ValueError(
                f"split_axis {split_axis} of shape {x.shape} does not divide into "
                f"{self.axis_size} pieces"
            )

        def host_start(position: np.ndarray, value: np.ndarray) -> np.ndarray:
            position = int(position)
            pieces = np.split(np.asarray(value), self.axis_size, axis=split_axis)
            for index, piece in enumerate(pieces):
                self.transport.send(key, position, self._peer(position, index), piece)
            return np.float32(0)

        return io_callback(host_start, jax.ShapeDtypeStruct((), jnp.float32), self._position(), x)

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

        def host_done(position: np.ndarray, _token: np.ndarray, _after: np.ndarray) -> Any:
            position = int(position)
            pieces = [
                np.frombuffer(
                    self.transport.mailbox.take((key, self._peer(position, index), position)),
                    dtype,
                ).reshape(piece_shape)
                for index in range(self.axis_size)
            ]
            joined = np.concatenate(pieces, axis=concat_axis)
            return (joined, np.float32(0)) if release_token else joined

        shapes = (result, jax.ShapeDtypeStruct((), jnp.float32)) if release_token else result
        return io_callback(host_done, shapes, self._position(), token, _scalar(after))


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

    The emitter (``scheduling.runtime.emit``) walks the planned order and calls ``start`` and
    ``done`` for each all-to-all pair this supports, ``pin`` on the inputs of every other
    op and ``record`` after it. The matmuls (``dot_general``), the bulk of the work, are
    the anchors that keep the planned order:

    - a matmul after a start consumes that start's token (exactly, on its last floating
      operand), unless one of its inputs already comes after it; a start's operand is
      pinned the same way, so the latest token orders an op after every earlier start;
    - a done takes a running scalar of the first operand of every matmul recorded before
      it, so it waits until all the matmuls planned before it can run.

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

    def start(self, node: int, operand: jax.Array, params: dict) -> None:
        axis = params["axis_name"]
        axis = axis[0] if isinstance(axis, tuple) else axis
        op = self._ops.setdefault(axis, SocketAllToAll(self.transport, axis))
        (operand,) = self.pin("dot_general", [operand])
        token = op.start(operand, key=node, split_axis=params["split_axis"])
        self._pending[node] = (
            op,
            token,
            jax.ShapeDtypeStruct(operand.shape, operand.dtype),
            params,
        )
        self._starts += 1
        self._token = token

    def now(self, node: int, operand: jax.Array, params: dict) -> jax.Array:
        """The all-to-all run synchronously: its start, then its done at once. The done
        waits for every matmul recorded before it, and releases a token that every later
        matmul consumes (unless it already uses the result), so no planned matmul runs
        while the pieces travel: the same transport as the scheduled pairs, no overlap."""
        self.start(node, operand, params)
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
