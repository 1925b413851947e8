"""Sections of a results file kept from its previous run, for runs that skip a part."""

from __future__ import annotations

import re
from pathlib import Path

KEPT = "Kept from an earlier run"


def kept_section(path: Path, heading: str, end: str | None, flag: str) -> list[str]:
    """The section of an earlier results file from ``heading`` up to ``end`` (or to the
    end of the file), with a note naming the command that made it; empty when the file or
    the section is missing. A section kept before keeps its note (and so its command)."""
    text = path.read_text() if path.exists() else ""
    if heading not in text or (end is not None and end not in text[text.index(heading) :]):
        return []
    start = text.index(heading)
    stop = len(text) if end is None else text.index(end, start)
    section = text[start:stop].rstrip().splitlines()
    body = "\n".join(section[1:]).strip().splitlines()
    if body and body[0].startswith("Kept from"):  # and older notes, worded otherwise
        return [section[0], "", *body, ""]
    command = re.search(r"^Command: `(.*)`$", text, re.MULTILINE)
    made_by = f", made by `{command.group(1)}`" if command else ""
    note = f"{KEPT}{made_by} (`{flag}` does not rerun it)."
    return [section[0], "", note, "", *body, ""]
