"""An experiment against another source tree: a function of it run there (sent as its
source to a fresh process with that tree first on ``sys.path``, its result read back as
JSON), the names such a function reads without binding them (it may read none of its
module: only its source travels), the commit a tree is at, and the command line with the
tree's path as ``DIR`` (results files name its commit instead)."""

from __future__ import annotations

import ast
import builtins
import inspect
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_in_tree(
    tree: Path,
    function: Callable[..., Any],
    arguments: tuple,
    environment: dict[str, str] | None = None,
) -> Any:
    """``function(*arguments)`` in a fresh process that imports ``tree``'s packages (on the
    CPU, with ``environment`` set besides), its JSON result; raises with the end of its
    errors where it fails."""
    call = f"{function.__name__}{arguments!r}"
    code = f"import json\n{inspect.getsource(function)}\nprint(json.dumps({call}))"
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu", **(environment or {}))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{tree}: {function.__name__} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def commit_of(tree: Path) -> str:
    """``tree``'s commit and subject (its changes uncommitted not said)."""
    found = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h %s"], capture_output=True, text=True
    )
    return found.stdout.strip() or "a tree outside git"


def unbound_names(function: Callable[..., Any]) -> set[str]:
    """The names ``function`` reads that are none of its arguments, its assignments, its
    imports, its nested functions (and their arguments) or builtins: what it would need of
    its module in another tree (none, for :func:`run_in_tree`)."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(function))).body
    bound = set(vars(builtins))
    for inner in ast.walk(node):
        if isinstance(inner, ast.alias):
            bound.add((inner.asname or inner.name).split(".")[0])
        elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
            bound.add(inner.id)
        elif isinstance(inner, ast.FunctionDef):
            bound.add(inner.name)
            bound.update(a.arg for a in (*inner.args.args, *inner.args.kwonlyargs))
    read = {inner.id for inner in ast.walk(node) if isinstance(inner, ast.Name)}
    return read - bound


def naming_dir(argv: list[str]) -> list[str]:
    """``argv`` with the other tree's path (``--against PATH``) as ``DIR``."""
    named = list(argv)
    for index, arg in enumerate(argv):
        if arg == "--against" and index + 1 < len(argv):
            named[index + 1] = "DIR"
        elif arg.startswith("--against="):
            named[index] = "--against=DIR"
    return named
