"""The data section: where the training text comes from."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmoe.config.checks import check_types, positive_int, require


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from."""

    # A text file (bytes), or a .bin of token ids: with its sidecar NAME.json (written by
    # `jaxmoe data`) in the sidecar's dtype, without one uint16; None = the Python
    # standard library sources.
    path: str | None = None
    # The last this fraction of the corpus's tokens is the validation split.
    val_fraction: float = 0.05
    # Read at most this many bytes of the default corpus (None = all of it).
    max_bytes: int | None = 8_000_000
    # Keep the loss and attention inside documents: no target after an end-of-document
    # token, attention and positions restart there (needs a corpus with an
    # end-of-document id: one that `jaxmoe data` wrote).
    mask_across_documents: bool = False

    def __post_init__(self) -> None:
        check_types("data", self)
        require(
            isinstance(self.val_fraction, float | int) and 0 < self.val_fraction < 1,
            f"data.val_fraction={self.val_fraction!r}: must be in (0, 1)",
        )
        if self.max_bytes is not None:
            positive_int("data", "max_bytes", self.max_bytes)
        require(
            not self.mask_across_documents or self.path is not None,
            "data.mask_across_documents=True: the default byte corpus has no end-of-document "
            "token; give a corpus made by `jaxmoe data` with --data",
        )
