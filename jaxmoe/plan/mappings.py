"""Every parallel mapping of one model onto N devices, as configurations (no JAX here).

A mapping is a layout: the attention layout (data x context x tensor), the MoE layout
(expert data x expert x expert tensor) over the same N devices, and the token dispatcher
between them
(see :mod:`jaxmoe.config.layout`); and the options it runs with (:mod:`jaxmoe.plan.
options`: ZeRO stage, recomputation, microbatches). The model, the global batch and every
other setting stay the preset's. Each candidate is validated by
:class:`~jaxmoe.config.Config` itself, so a mapping is offered exactly when ``jaxmoe
train`` would accept it; the others are kept with the reason it gives.

Layouts whose tensor group (attention's, or an expert's) is wider than a node are
skipped unless asked for (``max_tensor``): such a group exchanges activations in every
layer, forward and backward, over the links between nodes instead of the node's own
(Megatron-Core and MaxText keep tensor parallelism inside a node for this reason).

Context parallelism is tried, with both of its exchanges, at the degrees whose chunks of a
sequence hold at least :data:`MIN_CONTEXT_CHUNK` positions (:func:`context_degrees`):
shorter chunks make a ring step's transfer about as long as the attention that hides it,
and a model of short sequences fits without splitting them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from jaxmoe.config import Config, ConfigError, ParallelConfig
from jaxmoe.config.choices import CONTEXT_EXCHANGES, DISPATCHERS
from jaxmoe.plan.options import Options, options_of

# The fewest positions of a context-parallel chunk the planner tries (a sequence of 2C
# chunks over a context group of C devices).
MIN_CONTEXT_CHUNK = 2048


@dataclass(frozen=True)
class Mapping:
    """One way to lay the model out on ``devices`` devices."""

    devices: int
    tensor: int  # attention: tensor (and sequence) parallel group
    expert_data: int  # MoE: replicas of each expert (parallel.data)
    expert: int  # MoE: the group the experts are spread over
    expert_tensor: int  # MoE: each expert's hidden dimension split
    dispatcher: str
    zero: int = 0  # train.zero
    recompute: str = "none"  # model.recompute
    microbatches: int = 1  # train.microbatches
    pipeline: int = 1  # stages, each of devices / pipeline devices laid out as above
    virtual_stages: int = 1  # chunks of layers per stage (the interleaved schedule)
    context: int = 1  # attention: each sequence split over this many devices
    context_exchange: str = "ring"  # how they exchange keys and values

    @property
    def attention_data(self) -> int:
        return self.devices // (self.pipeline * self.context * self.tensor)

    @property
    def attention_label(self) -> str:
        """The attention layout: data x tensor, or data x context x tensor (exchange)."""
        if self.context == 1:
            return f"{self.attention_data}x{self.tensor}"
        exchange = "ring" if self.context_exchange == "ring" else "ag"
        return f"{self.attention_data}x{self.context}x{self.tensor} {exchange}"

    @property
    def options(self) -> Options:
        return Options(self.zero, self.recompute, self.microbatches)

    @property
    def layout(self) -> Mapping:
        """This mapping with the default options: the layout alone."""
        return dataclasses.replace(self, **dataclasses.asdict(Options()))

    @property
    def stage_layout(self) -> tuple[int, int, int, str, int, str]:
        """What a stage's devices do: tensor, expert, expert tensor, dispatcher, context and
        its exchange."""
        return (
            self.tensor,
            self.expert,
            self.expert_tensor,
            self.dispatcher,
            self.context,
            self.context_exchange,
        )

    def with_options(self, options: Options) -> Mapping:
        return dataclasses.replace(self, **dataclasses.asdict(options))

    def label(self) -> str:
        """The layout, then the options where they are not the defaults (no ZeRO, no
        recomputation, one microbatch)."""
        options = "" if self.options == Options() else f", {self.options.label()}"
        pipeline = ""
        if self.pipeline > 1:
            virtual = f" ({self.virtual_stages} virtual)" if self.virtual_stages > 1 else ""
            pipeline = f", pipeline {self.pipeline}{virtual}"
        return (
            f"attention {self.attention_label}, MoE {self.expert_data}x"
            f"{self.expert}x{self.expert_tensor}, {self.dispatcher}{pipeline}{options}"
        )

    def to_json(self) -> dict[str, int | str]:
        return {**dataclasses.asdict(self), "attention_data": self.attention_data}


@dataclass(frozen=True)
class Candidate:
    mapping: Mapping
    config: Config | None  # None when the mapping is invalid
    reason: str = ""  # why it is invalid, or why it was not tried


@dataclass(frozen=True)
class MappingSpace:
    valid: list[Candidate]
    skipped: list[Candidate]

    def skipped_summary(self) -> list[str]:
        """One line per reason: how many mappings it ruled out, and one of them."""
        by_reason: dict[str, list[Mapping]] = {}
        for candidate in self.skipped:
            by_reason.setdefault(candidate.reason, []).append(candidate.mapping)
        return [
            f"{len(mappings)} x {reason} (e.g. {mappings[0].label()})"
            for reason, mappings in sorted(by_reason.items(), key=lambda item: -len(item[1]))
        ]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_mapping(config: Config, mapping: Mapping, devices_per_host: int) -> Config:
    """``config`` laid out as ``mapping`` (raises ConfigError where it does not fit).

    ``devices_per_host``: the gradient-sync algorithms' host size when the config leaves
    it to the processes (0), since the modelled cluster is not this process."""
    values = config.to_dict()
    values["parallel"] = dataclasses.asdict(
        ParallelConfig(
            data=mapping.expert_data,
            expert=mapping.expert,
            tensor=mapping.tensor,
            expert_tensor=mapping.expert_tensor,
            context=mapping.context,
            context_exchange=mapping.context_exchange,
            pipeline=mapping.pipeline,
            virtual_stages=mapping.virtual_stages,
            chunk_layers=chunk_layers_of(
                config.model.num_layers,
                config.model.moe_every,
                mapping.pipeline * mapping.virtual_stages,
            )
            if mapping.pipeline > 1
            else None,
        )
    )
    values["moe"]["dispatcher"] = mapping.dispatcher
    values["train"]["zero"] = mapping.zero
    values["train"]["microbatches"] = mapping.microbatches
    values["model"]["recompute"] = mapping.recompute
    if not values["train"]["grad_sync_devices_per_host"]:
        values["train"]["grad_sync_devices_per_host"] = math.gcd(mapping.devices, devices_per_host)
    return Config.from_dict(values)


def enumerate_mappings(
    config: Config,
    devices: int,
    devices_per_host: int = 0,
    max_tensor: int | None = None,
    pipelines: Sequence[tuple[int, int]] = ((1, 1),),
    contexts: Sequence[int] = (1,),
) -> MappingSpace:
    """Every layout of ``config``'s model onto ``devices`` devices, valid or not, with the
    options ``config`` runs with.

    ``devices_per_host``: see :func:`with_mapping` (0: all devices on one host).
    ``max_tensor``: the widest tensor group (attention's and an expert's) tried (None: any;
    see the module docstring). ``pipelines``: the (stages, virtual stages) tried, each
    dividing the devices into stages laid out alike. ``contexts``: the context degrees
    tried, each with both exchanges (:func:`context_degrees`). Without an expert group
    (expert x expert tensor = 1) every dispatcher is the same program, so only the first
    is tried.
    """
    if devices < 1:
        raise ConfigError(f"--devices {devices}: must be a positive number of devices")
    options = dataclasses.asdict(options_of(config))
    valid, skipped = [], []
    for stages, virtual in pipelines:
        if devices % stages:
            continue
        _enumerate_stage(
            config, devices, stages, virtual, options, devices_per_host, max_tensor,
            contexts, valid, skipped,
        )  # fmt: skip
    return MappingSpace(valid, skipped)


def pipelines_of(config: Config, devices: int, max_virtual_stages: int = 2) -> list:
    """The (stages, virtual stages) a plan of ``config``'s model on ``devices`` devices
    tries: stages that divide the devices, each with up to ``max_virtual_stages`` chunks
    per stage, where every chunk gets at least one whole block of layers (the chunks
    uneven where the blocks do not divide: :func:`chunk_layers_of`; 1: no pipeline
    first)."""
    model = config.model
    found = [(1, 1)]
    if model.num_layers % model.moe_every:
        return found
    blocks = model.num_layers // model.moe_every
    for stages in divisors(devices)[1:]:
        for virtual in range(1, max_virtual_stages + 1):
            if stages * virtual <= blocks:
                found.append((stages, virtual))
    return found


def context_degrees(config: Config, devices: int) -> list[int]:
    """The context degrees a plan of ``config``'s model on ``devices`` devices tries: 1,
    and each divisor of the devices whose chunks hold at least :data:`MIN_CONTEXT_CHUNK`
    positions of a sequence (module docstring)."""
    seq_len = config.model.seq_len
    return [
        degree
        for degree in divisors(devices)
        if degree == 1
        or (seq_len % (2 * degree) == 0 and seq_len // (2 * degree) >= MIN_CONTEXT_CHUNK)
    ]


def chunk_layers_of(num_layers: int, moe_every: int, chunks: int) -> str | None:
    """``parallel.chunk_layers`` of ``chunks`` chunks over the model's blocks of
    ``moe_every`` layers, as even as whole blocks allow (the first chunks one block
    more); None where they split evenly."""
    blocks = num_layers // moe_every
    if blocks % chunks == 0:
        return None
    share, extra = divmod(blocks, chunks)
    counts = [(share + (chunk < extra)) * moe_every for chunk in range(chunks)]
    return ",".join(map(str, counts))


def _enumerate_stage(
    config: Config,
    devices: int,
    stages: int,
    virtual: int,
    options: dict,
    devices_per_host: int,
    max_tensor: int | None,
    contexts: Sequence[int],
    valid: list[Candidate],
    skipped: list[Candidate],
) -> None:
    """The layouts of one pipeline stage's ``devices // stages`` devices (all of them
    without a pipeline), into ``valid`` and ``skipped``."""
    stage = devices // stages
    splits = [
        (context, exchange)
        for context in contexts
        if stage % context == 0
        for exchange in (CONTEXT_EXCHANGES if context > 1 else CONTEXT_EXCHANGES[:1])
    ]
    for tensor, (context, exchange) in itertools.product(divisors(stage), splits):
        for expert_tensor in divisors(stage):
            for expert in divisors(stage // expert_tensor):
                expert_data = stage // (expert * expert_tensor)
                for dispatcher in DISPATCHERS:
                    mapping = Mapping(
                        devices, tensor, expert_data, expert, expert_tensor, dispatcher,
                        **options, pipeline=stages, virtual_stages=virtual,
                        context=context, context_exchange=exchange,
                    )  # fmt: skip
                    if max_tensor is not None and max(tensor, expert_tensor) > max_tensor:
                        reason = (
                            f"a tensor group of {max(tensor, expert_tensor)} devices is wider "
                            f"than a node ({max_tensor}): its per-layer exchanges cross nodes"
                        )
                        skipped.append(Candidate(mapping, None, reason))
                        continue
                    try:
                        laid_out = with_mapping(config, mapping, devices_per_host or devices)
                    except ConfigError as error:
                        skipped.append(Candidate(mapping, None, str(error)))
                        continue
                    if expert * expert_tensor == 1 and dispatcher != DISPATCHERS[0]:
                        reason = f"no expert group: the same program as {DISPATCHERS[0]}"
                        skipped.append(Candidate(mapping, None, reason))
                        continue
                    valid.append(Candidate(mapping, laid_out))


def with_options(candidate: Candidate, options: Options, devices_per_host: int) -> Candidate:
    """``candidate``'s layout with ``options`` (its config None, and the reason, where
    Config refuses them)."""
    mapping = candidate.mapping.with_options(options)
    try:
        return Candidate(mapping, with_mapping(candidate.config, mapping, devices_per_host))
    except ConfigError as error:
        return Candidate(mapping, None, str(error))
