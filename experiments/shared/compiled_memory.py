"""One device's peak memory of a compiled step, from XLA's memory analysis."""

from __future__ import annotations

from typing import Any


def compiled_peak(analysis: Any) -> int:
    """Arguments, outputs not aliased to the (donated) arguments, and temporaries."""
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )
