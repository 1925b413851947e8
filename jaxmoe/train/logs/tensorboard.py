"""The run for TensorBoard: its metrics, its configuration and its traces, in ``DIR/tensorboard``.

``tensorboard --logdir DIR`` shows them. Each row of ``metrics.jsonl`` becomes summaries at
its step, tagged ``SECTION/KEY`` with the row's keys (:func:`metric_tag`: ``train/loss``,
``eval/val_loss``, ``time/step_time_s``, ``routing/dropped_fraction``, ...): a scalar for
each number (TensorBoard keeps scalars as float32), and for each per-MoE-layer array
(``tokens_per_expert``, ...) a histogram of each layer's values,
``routing/tokens_per_expert/<layer>``. The resolved configuration is the text summary
``config``, a JSON code block of ``config.json``, at the step each invocation starts from.
``jaxmoe train --profile-steps`` writes its ``jax.profiler`` trace into the same directory
(:func:`log_dir`), under ``plugins/profile/<session>/``, where TensorBoard's profile plugin
finds it.

**Resuming.** Each invocation writes an event file of its own, which opens with a restart
(``SessionLog.START``) at the invocation's first step: TensorBoard then drops whatever the
earlier files hold at or after that step (the steps after the checkpoint, which the resumed
run does again), so every curve has one point per step, as ``metrics.jsonl`` has one row.

**Writing.** tensorboardX (pure Python; no TensorFlow) makes the events: its protocol
buffers, summaries and record checksums. They are written here, in the training thread, a
row's events in one write that is cut back when it fails (:mod:`jaxmoe.train.logs.appends`, as
``metrics.jsonl``'s lines are), so that a failed write stops the run with
``exit_codes.IO_ERROR`` and the file holds whole records only. tensorboardX's own
``SummaryWriter`` writes from a thread of its own: an error there ends that thread unseen
by the run, and the writes after it wait forever on its full queue. Each row reaches the
operating system when it is written (a process that ends at once loses none);
:meth:`TensorBoardLog.flush` (at each checkpoint) and :meth:`TensorBoardLog.close` put it on
disk.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tensorboardX import summary as summaries
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c

from jaxmoe.config import Config
from jaxmoe.train.logs.appends import append_whole

TENSORBOARD_DIR = "tensorboard"
CONFIG_TAG = "config"
HISTOGRAM_BUCKETS = 30  # equal buckets between the least and the greatest value, as tf.summary's

# The section of each metrics.jsonl key in TensorBoard; any other key is a training metric.
_SECTIONS = {
    "eval": ("val_loss",),
    "time": ("step_time_s", "tokens_per_s", "mfu", "checkpoint_s"),
    "routing": (
        "dropped_fraction",
        "expert_imbalance",
        "tokens_per_expert",
        "device_load",
        "kept_per_expert",
        "kept_by_copies",
        "replicas_per_expert",
    ),
}
_SECTION_OF = {key: section for section, keys in _SECTIONS.items() for key in keys}


def log_dir(out_dir: str | Path) -> Path:
    """The run's TensorBoard log directory."""
    return Path(out_dir) / TENSORBOARD_DIR


def metric_tag(key: str) -> str:
    """The TensorBoard tag of the ``metrics.jsonl`` key ``key``."""
    return f"{_SECTION_OF.get(key, 'train')}/{key}"


def _values(key: str, value: Any) -> Iterator[Summary.Value]:
    """A number's scalar, or a histogram of each layer's values of a per-layer array."""
    array = np.asarray(value, dtype=np.float64)
    tag = metric_tag(key)
    if array.ndim == 0:
        yield Summary.Value(tag=tag, simple_value=float(array))
        return
    if array.ndim == 1:
        named = [(tag, array)]
    else:
        layers = array.reshape(-1, array.shape[-1])
        named = [(f"{tag}/{layer}", values) for layer, values in enumerate(layers)]
    for name, values in named:
        finite = values[np.isfinite(values)]
        if finite.size:  # a histogram of nothing cannot be written
            yield from summaries.histogram(name, finite, bins=HISTOGRAM_BUCKETS).value


def row_summary(row: dict[str, Any]) -> Summary:
    """The summaries of one ``metrics.jsonl`` row (its ``step`` is the events' step)."""
    return Summary(
        value=[value for key, item in row.items() if key != "step" for value in _values(key, item)]
    )


def config_summary(config: Config) -> Summary:
    """The configuration as the text summary :data:`CONFIG_TAG`, as ``config.json`` holds it."""
    text = "```json\n" + json.dumps(config.to_dict(), indent=2) + "\n```"
    return summaries.text(CONFIG_TAG, text)


def _checksum(data: bytes) -> bytes:
    return struct.pack("<I", masked_crc32c(data))


def _record(data: bytes) -> bytes:
    """One TFRecord: the length, its checksum, the data, its checksum."""
    length = struct.pack("<Q", len(data))
    return length + _checksum(length) + data + _checksum(data)


class TensorBoardLog:
    """Writes a run's events into ``directory`` from step ``first_step`` on: the restart at
    ``first_step``, the configuration, then each row given to :meth:`write`."""

    def __init__(self, directory: str | Path, config: Config, first_step: int):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # Named so that the files of a run sort in the order they were written.
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        self.path = directory / name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
        self._fd: int | None = os.open(self.path, flags, 0o644)
        now = time.time()
        restart = SessionLog(status=SessionLog.START)
        try:
            self._append(
                Event(wall_time=now, file_version="brain.Event:2"),
                Event(wall_time=now, step=first_step, session_log=restart),
                Event(wall_time=now, step=first_step, summary=config_summary(config)),
            )
        except OSError:
            os.close(self._fd)
            self._fd = None
            raise

    def _append(self, *events: Event) -> None:
        append_whole(self._fd, b"".join(_record(event.SerializeToString()) for event in events))

    def write(self, row: dict[str, Any]) -> None:
        """The summaries of ``row`` at its step, whole; raises OSError if they cannot be."""
        self._append(Event(wall_time=time.time(), step=row["step"], summary=row_summary(row)))

    def flush(self) -> None:
        """Put everything written so far on disk."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
