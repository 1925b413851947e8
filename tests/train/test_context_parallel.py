"""Context parallelism trains as the unsplit sequence does, and its ring is scheduled exactly.

Each case trains a family's tiny preset (one MoE layer, two under a pipeline; rows of 32
positions, attention tiles of 4) for 5 steps on 8 fake devices with its sequences split
over a context group, and the same model with whole sequences on every device: losses,
gradient norms and the routers' losses within 1e-5 relative, the same tokens routed to
each expert and the same fraction dropped (capacity factor 1: about a third of the
assignments drop). Mixtral's rows are packed documents (end-of-document tokens inside and
on the edges of chunks), so attention, positions and the loss restart inside a device's
chunks; DeepSeek-V3's (latent attention, multi-token prediction, sequence-wise balance
loss) split over context and tensor groups at once.
"""

import dataclasses
import functools

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxmoe.config import Config, DataConfig, DataSource, ParallelConfig
from jaxmoe.data.corpus import CorpusInfo, write_info
from jaxmoe.parallel.mesh import build_mesh, token_spec
from jaxmoe.presets import preset
from jaxmoe.train.resolved import resolve
from jaxmoe.train.scheduled import (
    TrainStep,
    axis_roles,
    capture_train_step,
    scheduled_train_step,
)
from jaxmoe.train.state import init_train_state
from scheduling import Phase, collective_purposes
from tests.train.batches import compiled_step
from tests.train.runs import with_schedule

STEPS = 5
EOD = 1
WHOLE = ParallelConfig(expert=8)
CASES = {
    "mixtral-ring2-documents": ("mixtral-tiny", ParallelConfig(expert=8, context=2), True),
    "mixtral-all_gather4-documents": (
        "mixtral-tiny",
        ParallelConfig(expert=8, context=4, context_exchange="all_gather"),
        True,
    ),
    "deepseek_v3-ring2-tensor2": (
        "deepseek_v3-tiny",
        ParallelConfig(expert=8, context=2, tensor=2),
        False,
    ),
    "qwen2_moe-all_gather2-zero3": (
        "qwen2_moe-tiny",
        ParallelConfig(expert=8, context=2, context_exchange="all_gather"),
        False,
    ),
    "mixtral-ring2-pipeline2": (
        "mixtral-tiny",
        ParallelConfig(expert=2, context=2, pipeline=2, data=2),
        False,
    ),
}
# The exchange by all-gather is attention over the whole sequence in
# tests/layers/test_context_attention.py by default (4 ways, and 2 with documents); in the
# step, the ring by default and the all-gather here are slow.
SLOW = {"mixtral-all_gather4-documents", "qwen2_moe-all_gather2-zero3", "mixtral-ring2-pipeline2"}
EXACT = ("tokens_per_expert", "dropped_fraction")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A corpus whose sidecar names the end-of-document id, for document masks."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.bin"
    np.arange(64 * 32, dtype="<u2").tofile(path)
    write_info(path, CorpusInfo("uint16", 256, EOD, "<eod>", None, documents=4, tokens=64 * 32))
    return str(path)


def config(family: str, parallel: ParallelConfig, corpus: str | None) -> Config:
    base = preset(family)
    # The sequence is split in attention (and the losses): one layer shows it, two stages
    # need two.
    layers = 2 if parallel.pipeline > 1 else 1
    model = dataclasses.replace(
        base.model,
        num_layers=layers,
        first_dense_layers=min(base.model.first_dense_layers, layers - 1),
        seq_len=32,
        attention="blockwise",
        attention_block=4,
    )
    train = dataclasses.replace(base.train, batch_size=8, steps=STEPS)
    if parallel.pipeline > 1:
        train = dataclasses.replace(train, microbatches=2)
    data = DataConfig()
    if corpus is not None:
        data = DataConfig(sources=(DataSource(corpus),), mask_across_documents=True)
    return dataclasses.replace(base, model=model, parallel=parallel, train=train, data=data)


def _rows(rng: np.random.Generator, config: Config) -> np.ndarray:
    """Byte tokens with two end-of-document tokens a row, at random places."""
    rows = rng.integers(2, 256, (config.train.batch_size, config.model.seq_len + 1))
    for row in rows:
        row[rng.integers(0, config.model.seq_len, 2)] = EOD
    return rows.astype(np.int32)


@functools.cache
def train(config: Config) -> list[dict]:
    """Each step's metrics of ``config``'s plain step (kept for the module: the first case's
    split run is the unscheduled reference of the ring's schedule too)."""
    return run_steps(config, *compiled_step(config))


def run_steps(config: Config, mesh, step) -> list[dict]:
    """Each step's metrics of ``STEPS`` steps of ``step`` from ``config``'s initial state."""
    state = init_train_state(resolve(config, mesh))
    rng = np.random.default_rng(0)
    history = []
    for _ in range(STEPS):
        batch = jax.device_put(_rows(rng, config), NamedSharding(mesh, token_spec(mesh)))
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return history


@functools.cache
def _whole(family: str, documents: bool, corpus: str, pipeline: bool, zero: int) -> list[dict]:
    parallel = ParallelConfig(expert=2, pipeline=2, data=2) if pipeline else WHOLE
    whole = config(family, parallel, corpus if documents else None)
    return train(dataclasses.replace(whole, train=dataclasses.replace(whole.train, zero=zero)))


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES]
)
def test_context_parallelism_trains_as_whole_sequences(case, corpus):
    family, parallel, documents = CASES[case]
    zero = 3 if "zero3" in case else 0
    split = config(family, parallel, corpus if documents else None)
    split = dataclasses.replace(split, train=dataclasses.replace(split.train, zero=zero))
    history = train(split)
    expected = _whole(family, documents, corpus, parallel.pipeline > 1, zero)
    assert 0.2 < expected[0]["dropped_fraction"] < 0.5  # the comparison sees drops
    for got, want in zip(history, expected, strict=True):
        for name in EXACT:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        close = {name: got[name] for name in want if name not in EXACT}
        chex.assert_trees_all_close(close, {name: want[name] for name in close}, rtol=1e-5)


def _ring(corpus: str) -> Config:
    """The first case's configuration (its plain step is compiled and its run done already
    when the tests share a process)."""
    family, parallel, _ = CASES["mixtral-ring2-documents"]
    return config(family, parallel, corpus)


@pytest.fixture(scope="module")
def scheduled_ring(corpus) -> tuple[Config, TrainStep]:
    """The first case under the ``dw`` schedule and its step, scheduled once for its report
    and its run."""
    dw = with_schedule(_ring(corpus), "dw")
    return dw, scheduled_train_step(resolve(dw, build_mesh(dw.parallel)))


def test_the_ring_is_named_and_its_transfers_run_beside_attention_under_a_schedule(
    corpus, scheduled_ring
):
    ring_config = _ring(corpus)
    program, _ = capture_train_step(resolve(ring_config, build_mesh(ring_config.parallel)))
    purposes = collective_purposes(program, axis_roles())
    ring = [op for op, purpose in purposes.items() if purpose == "context ppermute (ring)"]
    # One step a layer (a group of two), keys and values each, over 1 layer; the backward
    # pass passes the blocks again, their gradients with them, and the gradients home.
    phases = [op.phase for op in ring]
    assert phases.count(Phase.FORWARD) == 1 * 2
    assert phases.count(Phase.BACKWARD) == (1 + 1 + 1) * 2
    report = scheduled_ring[1].report
    transfers = [c for c in report.collectives if c.purpose == "context ppermute (ring)"]
    assert len(transfers) == len(ring) and all(c.is_async for c in transfers)
    # A step's transfer waits only for the block before it, so the attention of that block
    # runs inside its window: every forward transfer is hidden. The backward pass's last
    # transfer of a layer (the gradients going home) has only the rest of the step after
    # it; the layer's transfers are at least four fifths hidden all the same.
    forward = [c for c in transfers if c.phase == "forward"]
    assert all(c.why == "hidden" for c in forward), [c.why for c in forward]
    backward = [c for c in transfers if c.phase == "backward"]
    hidden = sum(c.overlap_seconds for c in backward) / sum(c.estimated_seconds for c in backward)
    assert hidden > 0.8, [c.why for c in backward]


def test_the_scheduled_ring_is_the_unscheduled_one_bit_for_bit(corpus, scheduled_ring):
    dw, step = scheduled_ring
    scheduled = run_steps(dw, build_mesh(dw.parallel), step.compile())
    chex.assert_trees_all_equal(scheduled, train(_ring(corpus)))
