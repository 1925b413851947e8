"""A function called in a fresh Python process whose CPU platform has N devices.

XLA reads the host platform's device count once, when JAX starts its backends, so a
command that needs another count than its own (the simulator at 16 or 32 GPUs, the
prediction on the emulated cluster's 2 devices) calls ``call_with_devices``: the function
runs in a new process (``python -m experiments.shared.device_process``) with that count,
its arguments and its result passed as JSON, its output going to this process's.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _name(function: Callable) -> str:
    """``module:qualname``, the module named as imported (not ``__main__``)."""
    module = function.__module__
    if module == "__main__":
        module = sys.modules["__main__"].__spec__.name
    return f"{module}:{function.__qualname__}"


def call_with_devices(devices: int, function: Callable, *args: Any) -> Any:
    """``function(*args)`` in a fresh process with ``devices`` CPU devices; its result.

    ``function`` must be importable by name, its arguments and result JSON-ready.

    Raises:
        RuntimeError: the process failed (its error output went to standard error).
    """
    from jaxmoe.cli.launch import child_environment

    env = child_environment()  # without this process's device count
    count = f"--xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {count}".strip()
    with tempfile.TemporaryDirectory(prefix="jaxmoe-call-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"function": _name(function), "args": list(args)}))
        argv = [sys.executable, "-m", __name__, str(request), str(result)]
        status = subprocess.run(argv, env=env, check=False).returncode
        if status != 0:
            raise RuntimeError(f"{_name(function)} on {devices} devices failed (status {status})")
        return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    request_path, result_path = sys.argv[1:] if argv is None else argv
    request = json.loads(Path(request_path).read_text())
    module, _, qualname = request["function"].partition(":")
    function: Any = importlib.import_module(module)
    for part in qualname.split("."):
        function = getattr(function, part)
    Path(result_path).write_text(json.dumps(function(*request["args"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
