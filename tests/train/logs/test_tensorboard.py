"""A run for TensorBoard: its metrics and configuration as TensorBoard's own reader loads
them, a resumed run's curves, and a failed write."""

import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxmoe.cli.main import main
from jaxmoe.train.logs import tensorboard
from jaxmoe.train.logs.metrics import read_rows
from tests.train.runs import ONE_LAYER, small_config

# The one-layer model: what is under test is the run's files, not the model.
SMALL = [*ONE_LAYER, "--no-progress", "--train.eval_every", "3"]
EVERYTHING = {"scalars": 0, "histograms": 0, "tensors": 0}  # 0: keep every event


def board(log_dir: Path) -> EventAccumulator:
    """What TensorBoard shows of ``log_dir`` (it drops the events a restart orphans)."""
    return EventAccumulator(str(log_dir), size_guidance=EVERYTHING).Reload()


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """Four steps with checkpoints after steps 2 and 4, then the checkpoint of step 4 lost
    (as if the run had died before it was written) and the run resumed up to six steps:
    steps 2 and 3 are trained, logged and evaluated twice."""
    out = tmp_path_factory.mktemp("resumed")
    every = ["--train.checkpoint_every", "2", "--out", str(out)]
    assert main(["train", *SMALL, "--steps", "4", *every]) == 0
    shutil.rmtree(out / "checkpoints" / "4")
    assert main(["train", *SMALL, "--steps", "6", *every, "--resume"]) == 0
    return out


def test_every_metric_of_every_row_is_in_tensorboard_once(resumed_run):
    rows = read_rows(resumed_run / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(6))
    events = board(tensorboard.log_dir(resumed_run))
    keys = {key for row in rows for key in row} - {"step"}
    numbers = {key for key in keys if not isinstance(rows[0].get(key, 0), list)}
    assert {"loss", "val_loss", "step_time_s", "tokens_per_expert"} <= keys
    assert set(events.Tags()["scalars"]) == {tensorboard.metric_tag(key) for key in numbers}

    for key in sorted(keys):
        logged = [row for row in rows if key in row]
        if key in numbers:  # one point per row, the row's value (TensorBoard keeps float32)
            points = events.Scalars(tensorboard.metric_tag(key))
            assert [point.step for point in points] == [row["step"] for row in logged], key
            expected = [float(np.float32(row[key])) for row in logged]
            assert [point.value for point in points] == expected, key
            continue
        for layer in range(len(logged[0][key])):  # a histogram of each MoE layer's values
            points = events.Histograms(f"{tensorboard.metric_tag(key)}/{layer}")
            assert [point.step for point in points] == [row["step"] for row in logged], key
            for point, row in zip(points, logged, strict=True):
                values = np.asarray(row[key][layer], dtype=np.float64)
                histogram = point.histogram_value
                summary = (histogram.num, histogram.sum, histogram.min, histogram.max)
                assert summary == (values.size, values.sum(), values.min(), values.max()), key


def test_each_invocation_logs_its_configuration_from_its_first_step(resumed_run):
    log_dir = tensorboard.log_dir(resumed_run)
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2  # one file per invocation
    texts = board(log_dir).Tensors(f"{tensorboard.CONFIG_TAG}/text_summary")
    assert [text.step for text in texts] == [0, 2]

    def config_of(text) -> dict:
        markdown = text.tensor_proto.string_val[0].decode()
        assert markdown.startswith("```json\n") and markdown.endswith("\n```")
        return json.loads(markdown.removeprefix("```json\n").removesuffix("\n```"))

    assert config_of(texts[1]) == json.loads((resumed_run / "config.json").read_text())
    assert config_of(texts[0])["train"]["steps"] == 4


def test_a_failed_write_raises_and_leaves_only_whole_events(tmp_path, monkeypatch):
    log = tensorboard.TensorBoardLog(tmp_path, small_config(), first_step=0)
    log.write({"step": 0, "loss": 1.5})
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, data[:7])  # part of the event reaches the disk, then it is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        log.write({"step": 1, "loss": 2.5})
    monkeypatch.undo()
    log.write({"step": 2, "loss": float("nan")})
    log.close()

    points = board(tmp_path).Scalars("train/loss")
    assert [point.step for point in points] == [0, 2]  # read past the failed write
    assert points[0].value == 1.5 and np.isnan(points[1].value)
