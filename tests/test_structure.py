"""The layout's rules, checked: one public scheduling API, no import cycles, no JAX to
read a configuration, JAX internals behind one adapter."""

import ast
import subprocess
import sys
from pathlib import Path

import scheduling

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxmoe", "scheduling", "experiments")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_outside_scheduling_only_its_public_api_is_imported():
    offenders = []
    for path in [*(ROOT / "jaxmoe").rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.startswith("scheduling.") and node.module != "scheduling.names":
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
                if node.module == "scheduling":
                    unknown = [a.name for a in node.names if a.name not in scheduling.__all__]
                    offenders += [f"{path.relative_to(ROOT)}: scheduling.{n}" for n in unknown]
    assert offenders == []


def test_scheduling_never_imports_jaxmoe_or_experiments():
    for path in (ROOT / "scheduling").rglob("*.py"):
        for name in _imports(path):
            assert not name.startswith(("jaxmoe", "experiments")), f"{path}: {name}"


def test_jax_internals_live_in_the_adapter_alone():
    users = {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "jax._src" in path.read_text()
    }
    assert users == {"scheduling/program/jax_adapter.py"}


def test_no_module_imports_itself_back():
    modules = _modules()
    # A module's own packages are already being imported when it runs: no edge to them.
    edges = {
        name: {
            imported
            for imported in _imports(path)
            if imported in modules and imported != name and not name.startswith(imported + ".")
        }
        for name, path in modules.items()
    }
    # Importing a.b.c imports the packages a and a.b first: an edge to each (but for the
    # importer's own packages, which are already being imported).
    for name, targets in edges.items():
        for target in list(targets):
            parts = target.split(".")
            packages = {".".join(parts[:i]) for i in range(1, len(parts))}
            targets.update(
                p for p in packages if p in modules and not (name + ".").startswith(p + ".")
            )
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in edges[node]:
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_reading_a_configuration_imports_no_jax():
    code = (
        "import sys; from jaxmoe.cli.parser import config_from_train_args; "
        "config_from_train_args(['--schedule', 'lancet', '--schedule.profile', 'cpu']); "
        "print('jax' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "False"
