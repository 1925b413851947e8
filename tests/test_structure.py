"""The layout's rules, checked: jaxmoe's packages import only those below them in the
order ``docs/architecture.md`` states, the scheduling layers imported in their order only,
one public scheduling API, no import cycles, no JAX to read a configuration, JAX internals
behind one adapter."""

import ast
import importlib
import re
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


# jaxmoe's layers, from the top: a module imports only from its own layer and those after
# it (docs/architecture.md, "Layout"). The loop sits above the planner, whose estimates it
# reports; the rest of train/ (the step and the state the planner traces) below it.
JAXMOE_LAYERS = (
    ("jaxmoe.cli",),
    ("jaxmoe.generate", "jaxmoe.hf"),
    ("jaxmoe.prepare",),
    ("jaxmoe.train.loop",),
    ("jaxmoe.plan",),
    ("jaxmoe.train",),
    ("jaxmoe.pipeline",),
    ("jaxmoe.losses",),
    ("jaxmoe.layers",),
    ("jaxmoe.placement",),
    ("jaxmoe.data",),
    ("jaxmoe.parallel",),
    ("jaxmoe.presets",),
    ("jaxmoe", "jaxmoe.exit_codes"),
    ("jaxmoe.config",),
)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:``: imports for annotations, never run."""
    return {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports when it runs (``from a.b import c`` gives ``a.b`` and
    ``a.b.c``); imports for annotations alone (``if TYPE_CHECKING:``) are left out."""
    names = []
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def _layer(module: str) -> int:
    """The index in :data:`JAXMOE_LAYERS` of the most specific layer holding ``module``."""
    holding = [
        (len(prefix), index)
        for index, layer in enumerate(JAXMOE_LAYERS)
        for prefix in layer
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert holding, f"{module} is in no layer of JAXMOE_LAYERS"
    return max(holding)[1]


def test_jaxmoe_imports_only_its_own_layer_and_those_below():
    offenders = []
    for name, path in _modules().items():
        if not name.startswith("jaxmoe"):
            continue
        for imported in _imports(path):
            if imported.startswith("jaxmoe") and _layer(imported) < _layer(name):
                offenders.append(f"{name} -> {imported}")
    assert offenders == []


def test_every_jaxmoe_package_has_a_layer():
    packages = {
        ".".join(path.relative_to(ROOT).parts[:-1])
        for path in (ROOT / "jaxmoe").rglob("__init__.py")
    }
    for package in packages:
        _layer(package)


def test_the_architecture_document_states_the_layers():
    text = (ROOT / "docs" / "architecture.md").read_text()
    stated = " -> ".join(", ".join(f"`{name}`" for name in layer) for layer in JAXMOE_LAYERS)
    assert stated in " ".join(text.split()), f"docs/architecture.md should state: {stated}"


def test_scheduling_never_imports_jaxmoe_or_experiments():
    for path in (ROOT / "scheduling").rglob("*.py"):
        for name in _imports(path):
            assert not name.startswith(("jaxmoe", "experiments")), f"{path}: {name}"


def _scheduling_layers() -> dict[str, int]:
    """Each unit of the scheduling package (a subpackage or a top-level module) -> its
    layer, as the package's docstring numbers them (``1. ``names``, ``profiles``...``)."""
    layers = {}
    for number, units in re.findall(r"^(\d+)\. ((?:``\w+``(?:, )?)+)", scheduling.__doc__, re.M):
        for unit in re.findall(r"``(\w+)``", units):
            layers[unit] = int(number)
    return layers


def test_the_scheduling_layers_are_those_of_the_package():
    units = {
        path.stem if path.parent.name == "scheduling" else path.parent.name
        for path in (ROOT / "scheduling").glob("*/__init__.py")
    } | {path.stem for path in (ROOT / "scheduling").glob("*.py") if path.stem != "__init__"}
    assert set(_scheduling_layers()) == units


def test_each_scheduling_layer_imports_only_the_layers_before_it():
    """A module imports from its own layer and from lower ones (type-only imports too):
    nothing of a layer above it, and nothing through the package's public API."""
    layers = _scheduling_layers()
    offenders = []
    for path in (ROOT / "scheduling").rglob("*.py"):
        parts = path.relative_to(ROOT / "scheduling").with_suffix("").parts
        if parts == ("__init__",):
            continue  # the public API, which names every layer
        unit = parts[0]
        for name in _imports(path):
            if not name.startswith("scheduling"):
                continue
            target = name.split(".")[1] if "." in name else None
            if target is None or target not in layers:
                if name != "scheduling":  # ``from scheduling import names`` gives both
                    offenders.append(f"{path.relative_to(ROOT)}: {name} (the public API)")
                continue
            if layers[target] > layers[unit]:
                offenders.append(f"{path.relative_to(ROOT)}: {name} (layer {layers[target]})")
    assert offenders == []


def test_the_public_api_is_the_type_checking_block_and_loads_each_name_from_there():
    tree = ast.parse((ROOT / "scheduling" / "__init__.py").read_text())
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    static = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in block.body
        for alias in node.names
    }
    assert sorted(static) == scheduling.__all__
    for name, (module, defined_as) in static.items():
        assert getattr(scheduling, name) is getattr(importlib.import_module(module), defined_as)
    # A submodule of the same name as its function leaves the public name to the function.
    importlib.import_module("scheduling.optimize")
    assert callable(scheduling.optimize)


def test_the_no_jax_part_of_the_public_api_imports_no_jax():
    code = (
        "import sys, scheduling; "
        "scheduling.SchedulePolicy(name='lancet', profile='cpu'); "
        "scheduling.ExperimentalOptions(partition_always=True); scheduling.PROFILES; "
        "print('jax' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "False"


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


def test_every_path_the_documents_name_exists():
    """Every path into the packages the README and docs name is in the tree (a name may
    be the prefix of files, ``cluster-*.json``; hidden caches are not committed)."""
    import glob
    import re

    documents = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "experiments/README.md"]
    missing = []
    for document in documents:
        for path in re.findall(
            r"(?<![\w/])((?:jaxmoe|scheduling|experiments)/[\w/.]*\w)", document.read_text()
        ):
            hidden = Path(path).name.startswith(".")
            if not hidden and not any(ROOT.glob(glob.escape(path) + "*")):
                missing.append(f"{document.relative_to(ROOT)}: {path}")
    assert missing == []


def test_train_holds_the_step_and_the_loop_only():
    """``jaxmoe/train/`` keeps to the step and the run loop: ten modules at most at its top
    (what a run writes for people to read lives in ``train/logs/``)."""
    modules = [p.name for p in (ROOT / "jaxmoe" / "train").glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 10, sorted(modules)
