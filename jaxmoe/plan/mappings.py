"""Every parallel mapping of one model onto N devices, as configurations (no JAX here).

A mapping is a layout: the attention layout (data x tensor), the MoE layout (expert data x
expert x expert tensor) over the same N devices, and the token dispatcher between them
(see :mod:`jaxmoe.parallel.layout`); and the options it runs with (:mod:`jaxmoe.plan.
options`: ZeRO stage, recomputation, microbatches). The model, the global batch and every
other setting stay the preset's. Each candidate is validated by
:class:`~jaxmoe.config.Config` itself, so a mapping is offered exactly when ``jaxmoe
train`` would accept it; the others are kept with the reason it gives.

Layouts whose tensor group (attention's, or an expert's) is wider than a node are
skipped unless asked for (``max_tensor``): such a group exchanges activations in every
layer, forward and backward, over the links between nodes instead of the node's own
(Megatron-Core and MaxText keep tensor parallelism inside a node for this reason).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from jaxmoe.config import Config, ConfigError, ParallelConfig
from jaxmoe.config.choices import DISPATCHERS
from jaxmoe.plan.options import Options, options_of


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

    @property
    def attention_data(self) -> int:
        return self.devices // self.tensor

    @property
    def options(self) -> Options:
        return Options(self.zero, self.recompute, self.microbatches)

    @property
    def layout(self) -> Mapping:
        """This mapping with the default options: the layout alone."""
        return dataclasses.replace(self, **dataclasses.asdict(Options()))

    def with_options(self, options: Options) -> Mapping:
        return dataclasses.replace(self, **dataclasses.asdict(options))

    def label(self) -> str:
        """The layout, then the options where they are not the defaults (no ZeRO, no
        recomputation, one microbatch)."""
        options = "" if self.options == Options() else f", {self.options.label()}"
        return (
            f"attention {self.attention_data}x{self.tensor}, MoE {self.expert_data}x"
            f"{self.expert}x{self.expert_tensor}, {self.dispatcher}{options}"
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
    config: Config, devices: int, devices_per_host: int = 0, max_tensor: int | None = None
) -> MappingSpace:
    """Every layout of ``config``'s model onto ``devices`` devices, valid or not, with the
    options ``config`` runs with.

    ``devices_per_host``: see :func:`with_mapping` (0: all devices on one host).
    ``max_tensor``: the widest tensor group (attention's and an expert's) tried (None: any;
    see the module docstring). Without an expert group (expert x expert tensor = 1) every
    dispatcher is the same program, so only the first is tried.
    """
    if devices < 1:
        raise ConfigError(f"--devices {devices}: must be a positive number of devices")
    options = dataclasses.asdict(options_of(config))
    valid, skipped = [], []
    for tensor in divisors(devices):
        for expert_tensor in divisors(devices):
            for expert in divisors(devices // expert_tensor):
                expert_data = devices // (expert * expert_tensor)
                for dispatcher in DISPATCHERS:
                    mapping = Mapping(
                        devices, tensor, expert_data, expert, expert_tensor, dispatcher,
                        **options,
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
    return MappingSpace(valid, skipped)


def with_options(candidate: Candidate, options: Options, devices_per_host: int) -> Candidate:
    """``candidate``'s layout with ``options`` (its config None, and the reason, where
    Config refuses them)."""
    mapping = candidate.mapping.with_options(options)
    try:
        return Candidate(mapping, with_mapping(candidate.config, mapping, devices_per_host))
    except ConfigError as error:
        return Candidate(mapping, None, str(error))
