"""Research options of the model and its placement: no part of a user's configuration.

An experiment that measures the library's behaviour against a baseline passes
:class:`ExperimentalOptions` where the run is resolved
(:func:`jaxmoe.train.resolved.resolve`, :func:`jaxmoe.prepare.prepare_run`); the
:class:`~jaxmoe.train.resolved.Run` carries them to what builds the model's MoE layers
and to the placement planner. The defaults are the library's behaviour. The scheduling
layer's own research options are :class:`scheduling.ExperimentalOptions`, which the
step gets (:func:`jaxmoe.train.scheduled.scheduled_train_step`).

``jaxmoe train`` refuses the configuration fields these options were (``--moe.replica_split``,
and a saved ``moe.replica_split`` other than ``balanced``), with a one-line hint:
:data:`jaxmoe.config.moe.EXPERIMENTAL_FIELDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxmoe.config.checks import require

if TYPE_CHECKING:
    from jaxmoe.config import MoEConfig

# How the ragged dropless dispatch splits an expert's rows over its replica copies
# (jaxmoe/layers/replicated.py): balanced from the step's own counts
# (jaxmoe/placement/copy_split.py), the library's; or dealt out evenly, the baseline
# experiments/dropless_placement.py measures it against.
REPLICA_SPLITS = ("balanced", "round_robin")


@dataclass(frozen=True)
class ExperimentalOptions:
    """Research options of the model and its placement (the defaults change nothing)."""

    # Ragged dropless dispatch with replica slots only: which of an expert's rows each of
    # its copies takes. balanced: chosen in the step from its routed counts, so the
    # devices' loads are as even as the replica table allows; round_robin: each source
    # deals an expert's rows evenly over its copies. The placement planner judges its
    # tables under the same split.
    replica_split: str = "balanced"

    def __post_init__(self) -> None:
        require(
            self.replica_split in REPLICA_SPLITS,
            f"ExperimentalOptions.replica_split={self.replica_split!r}: choose one of "
            f"{', '.join(REPLICA_SPLITS)}",
        )

    def check(self, moe: MoEConfig) -> None:
        """Raise :class:`~jaxmoe.config.ConfigError` where an option does not apply to the
        configuration's ``moe`` section."""
        require(
            self.replica_split == REPLICA_SPLITS[0] or moe.dropless_dispatch == "ragged",
            f"ExperimentalOptions.replica_split={self.replica_split!r} says how the ragged "
            "dispatch splits rows over an expert's copies: set moe.dropless_dispatch ragged, "
            "or leave it balanced",
        )


DEFAULT = ExperimentalOptions()
