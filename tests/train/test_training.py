"""Training the default preset on the default corpus lowers the loss."""

import dataclasses

from jaxmoe.config import DataConfig
from jaxmoe.prepare import prepare_run
from jaxmoe.presets import preset
from jaxmoe.train.loop import train


def test_thirty_steps_lower_the_loss_on_the_standard_library(tmp_path):
    config = preset("tiny")
    config = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, steps=30, eval_every=30, eval_batches=2),
        data=DataConfig(max_bytes=2_000_000),
    )
    rows = train(prepare_run(config), tmp_path, progress=False)
    assert len(rows) == 30
    first, last_five = rows[0]["loss"], [row["loss"] for row in rows[-5:]]
    assert max(last_five) < first - 1.0, (first, last_five)
    assert rows[-1]["val_loss"] < first - 1.0
