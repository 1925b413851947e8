"""Results files: the command line they record, the source tree it ran on, and the
sections a run that skips a part keeps from the file it overwrites."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

KEPT = "Kept from an earlier run"


def command_line(module: str, argv: Sequence[str]) -> str:
    """``python -m MODULE ARGV``, quoted for a shell: how a results file names its command."""
    return shlex.join(["python", "-m", module, *argv])


def source_tree() -> str:
    """The commit this checkout is at (short), with ``+`` where its files differ from it;
    ``unknown`` outside a git checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        found = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        if found.returncode:
            raise OSError(found.stderr.strip())
        return found.stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        edited = git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return "unknown"
    return commit + ("+" if edited else "")


def kept_section(path: Path, heading: str, end: str | None, flag: str) -> list[str]:
    """The section of an earlier results file from ``heading`` up to ``end`` (or to the
    end of the file), with a note naming the command that made it; empty when the file or
    the section is missing. A section kept before keeps its note (and so its command); one
    with a command line of its own is not said to be made by the file's command."""
    text = path.read_text() if path.exists() else ""
    if heading not in text or (end is not None and end not in text[text.index(heading) :]):
        return []
    start = text.index(heading)
    stop = len(text) if end is None else text.index(end, start)
    section = text[start:stop].rstrip().splitlines()
    body = "\n".join(section[1:]).strip().splitlines()
    if body and body[0].startswith("Kept from"):  # and older notes, worded otherwise
        return [section[0], "", *body, ""]
    # A section that names its own command (a measurement another tool made) says it;
    # otherwise it was made by the file's command.
    own = any(line.startswith("Command: `") for line in body)
    command = None if own else re.search(r"^Command: `(.*)`$", text, re.MULTILINE)
    made_by = f", made by `{command.group(1)}`" if command else ""
    note = f"{KEPT}{made_by} (`{flag}` does not rerun it)."
    return [section[0], "", note, "", *body, ""]
