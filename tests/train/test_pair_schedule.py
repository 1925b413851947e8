"""The pair schedule (every microbatch's pass beside another's, two at a time, each next
one joining as one ends: forward 0 and forward 1, then backward i and forward i+2 in turn)
computes the step as written: losses within 1e-5, the same tokens dropped, on the unfolded
layout and (slow) a folded one, and composed with lancet and comet (``pair_microbatches``);
its order really interleaves the microbatches (behind the barrier that holds each one from
six microbatches on, too), respects every dependence, and fills with dW work the windows
of the last backward pass, which runs on alone once the one beside it has ended."""

import dataclasses
import functools

import numpy as np
import pytest

import scheduling
from jaxmoe.config import Config, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from jaxmoe.parallel.mesh import build_mesh
from jaxmoe.pipeline.microbatches import ORDERED_FROM
from jaxmoe.train.resolved import resolve, schedule_policy
from jaxmoe.train.scheduled import capture_train_step
from scheduling.passes.pair_microbatches import pass_order
from tests.train.runs import linked, with_schedule
from tests.train.test_scheduled import run

STEPS = 2
LAYOUTS = {
    "2x4": ParallelConfig(data=2, expert=4),
    "folded-tensor2": ParallelConfig(data=2, expert=4, tensor=2),
}


def config(layout: str, num_layers: int = 2, microbatches: int = 3) -> Config:
    return Config(
        model=ModelConfig(d_model=32, num_heads=2, num_layers=num_layers, d_ff=64, seq_len=16),
        moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0),
        parallel=LAYOUTS[layout],
        train=TrainConfig(
            batch_size=8 * max(3, microbatches),
            warmup_steps=1,
            learning_rate=1e-2,
            microbatches=microbatches,
        ),
    )


@functools.cache
def trained(layout: str, schedule: str, pair: bool = False):
    return run(with_schedule(config(layout), schedule, pair_microbatches=pair), steps=STEPS)


@pytest.mark.parametrize(
    ("layout", "schedule", "pair"),
    [
        ("2x4", "pair", False),
        # The folded layout is another layout for the claim pair-2x4 checks: slow.
        pytest.param("folded-tensor2", "pair", False, marks=pytest.mark.slow),
        ("2x4", "lancet+comet", True),
    ],
    ids=["pair-2x4", "pair-folded", "lancet+comet+pairing"],
)
def test_the_paired_step_trains_as_written(layout, schedule, pair):
    (history, _), (expected, _) = trained(layout, schedule, pair), trained(layout, "none")
    for key in ("loss", "total_loss", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in history], [m[key] for m in expected], rtol=1e-5, err_msg=key
        )
    for key in ("dropped_fraction", "tokens_per_expert"):
        np.testing.assert_array_equal([m[key] for m in history], [m[key] for m in expected])


@functools.cache
def captured(microbatches: int):
    """The step of four layers (two MoE layers: a backward pass long enough to hold a
    forward one) in ``microbatches``, captured, and its batch inputs."""
    cfg = config("2x4", num_layers=4, microbatches=microbatches)
    mesh = build_mesh(cfg.parallel)
    program, sharded = capture_train_step(resolve(cfg, mesh))
    return cfg, mesh, program, scheduling.batch_inputs(program, sharded.batch_argnums)


class Paired:
    """The pair schedule of :func:`captured`'s step on ``profile``, read by pass."""

    def __init__(self, microbatches: int, profile):
        cfg, mesh, program, batch = captured(microbatches)
        self.program = program
        self.policy = schedule_policy(with_schedule(cfg, "pair", profile=profile))
        scheduled = scheduling.schedule(
            program, self.policy, scheduling.cost_model(self.policy, mesh), batch
        )
        self.graph, self.order = scheduled.graph, scheduled.order.nodes
        self.windows = scheduled.order.placement.windows
        self.position = {node: i for i, node in enumerate(self.order)}

    def pass_of(self, node):
        stack = self.graph.nodes[node].op.name_stack
        if not stack.startswith("microbatch_"):
            return None
        return int(stack.split("/")[0].split("_")[1]), self.graph.nodes[node].op.phase.value

    def nodes(self, microbatch, phase):
        return [n for n in range(len(self.order)) if self.pass_of(n) == (microbatch, phase)]

    def paired(self, host, guest):
        """``guest``'s nodes that run between the first and last node of ``host``."""
        span = [self.position[n] for n in self.nodes(*host)]
        inside = set(self.order[min(span) : max(span)])
        return [n for n in self.nodes(*guest) if n in inside]


@pytest.mark.parametrize("microbatches", [3, ORDERED_FROM])
def test_the_paired_order_interleaves_microbatches_and_respects_dependences(microbatches):
    # A slow link: the all-to-alls are long enough for the pairing to fill them.
    # From ORDERED_FROM microbatches on, microbatch i starts behind a barrier with the
    # gradients summed up to microbatch i - 3, work outside every pass that the program
    # writes after microbatch i - 1: the pairs still interleave.
    run = Paired(microbatches, linked("cpu", 50.0))
    graph, order, position, nodes, paired = (
        run.graph, run.order, run.position, run.nodes, run.paired
    )  # fmt: skip
    assert all(position[p] < position[n] for n in range(len(order)) for p in graph.preds[n])
    # Two passes run side by side, each next one joining as one ends, in pass_order:
    # (forward 0, forward 1), then backward i and forward i + 2 in turn.
    spans = {}
    for at, node in enumerate(order):
        if (found := run.pass_of(node)) is not None:
            spans[found] = (spans.get(found, (at, at))[0], at)
    assert sorted(spans, key=lambda p: spans[p][0]) == [
        (i, phase.value) for i, phase in pass_order(microbatches)
    ]
    for at in range(len(order)):
        assert sum(first <= at <= last for first, last in spans.values()) <= 2, at
    # Within microbatch i's backward pass runs a good part of microbatch i + 2's forward
    # pass, its all-to-alls among them, and once that has ended, backward i + 1 joins:
    # no pass but the last runs alone.
    for i in range(microbatches - 2):
        assert paired((i, "backward"), (i + 1, "backward")), i
        inside = paired((i, "backward"), (i + 2, "forward"))
        assert len(inside) > 0.25 * len(nodes(i + 2, "forward")), i
        exchanges = [n for n in inside if graph.nodes[n].op.primitive == "all_to_all"]
        assert len(exchanges) >= 2, i  # the forward dispatch and combine of an MoE layer
    # No pass runs alone: the first forward pass and the last backward pass have partners.
    last = microbatches - 1
    assert len(paired((0, "forward"), (1, "forward"))) > 0.25 * len(nodes(1, "forward"))
    assert len(paired((last - 1, "backward"), (last, "backward"))) > 0.25 * len(
        nodes(last, "backward")
    )
    if microbatches >= ORDERED_FROM:
        return
    # Without pairing, microbatch 1's forward pass comes after microbatch 0's backward
    # (with more microbatches, dw's placement may run some of it inside).
    plain = scheduling.schedule(run.program, dataclasses.replace(run.policy, name="dw"))
    plain_position = {node: i for i, node in enumerate(plain.order.nodes)}
    plain_backward = [plain_position[n] for n in nodes(0, "backward")]
    plain_forward = [plain_position[n] for n in nodes(1, "forward")]
    assert min(plain_forward) > max(plain_backward)


def test_the_last_backward_pass_fills_the_windows_it_runs_alone_with_dw_work():
    # On the CPU's own link a backward pass outlasts the pass beside it: once the
    # second-last backward pass has ended, the last one runs alone, and its all-to-alls
    # hold its dW work. The backward passes before it always have a pass beside them.
    run = Paired(ORDERED_FROM, "cpu")
    last = ORDERED_FROM - 1
    ended = max(run.position[n] for n in run.nodes(last - 1, "backward"))
    alone = [
        start
        for start, placed in run.windows.items()
        if run.pass_of(start) == (last, "backward") and run.position[start] > ended and placed
    ]
    assert alone
