"""The kernels of a compiled XLA module, read from its optimized HLO text: what each one
reads and writes, and of which class it is.

A kernel is an instruction of the entry computation (or of a loop or branch it runs) that
launches work on the device: a fusion, a custom call (a cuBLAS GEMM, cuDNN's attention),
a collective, a copy. Its bytes are its operands' and its results' sizes, as XLA's own
cost analysis counts a fusion's, with the exceptions XLA's analysis makes too: a fusion
whose root updates a slice in place writes the update alone and does not read the
buffer it updates, and an operand that a fusion only slices (statically or at a dynamic
offset) is read in the slices alone. One more, which XLA's analysis does not make but the
kernel does: an operand a fusion only gathers from is read in the rows gathered.
A loop's body counts its trip count times (``known_trip_count``).

Classes: ``matmul`` (GEMM fusions and custom calls), ``attention`` (cuDNN's fused
attention), ``reduction`` (fusions with a reduction among their results),
``elementwise`` (loop fusions, copies, slices and the rest), ``communication``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_ITEM_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8,
    "s64": 8, "u64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_NOT_KERNELS = frozenset(
    {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
     "partition-id", "replica-id", "opt-barrier", "domain", "add-dependency", "iota"}
)  # fmt: skip
_COMMUNICATION = re.compile(
    r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|ragged-all-to-all)"
)


def shape_bytes(text: str) -> int:
    """Bytes of an HLO type (an array, or a tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        size = _ITEM_BYTES.get(dtype)
        if size is None:
            continue
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += size * count
    return total


@dataclass
class _Instruction:
    name: str
    type: str
    opcode: str
    operands: list[str]
    attributes: str
    root: bool
    index: int | None = None  # a parameter's number


def _operands(rest: str) -> tuple[list[str], str]:
    depth, end = 1, len(rest)
    for index, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = index
            break
    return re.findall(r"%([\w.\-]+)", rest[:end]), rest[end + 1 :]


def computations(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """Every computation's instructions, and the entry computation's name."""
    found: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _COMPUTATION.match(line.strip())
        if header and not line.startswith(" "):
            current = header.group(2)
            found[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        match = _INSTRUCTION.match(line)
        if match:
            name, type_, opcode, rest = match.groups()
            operands, attributes = _operands(rest)
            root = line.lstrip().startswith("ROOT")
            index = int(re.match(r"\s*(\d+)", rest).group(1)) if opcode == "parameter" else None
            found[current].append(
                _Instruction(name, type_, opcode, operands, attributes, root, index)
            )
    return found, entry


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: str  # the class (module docstring)
    bytes: float  # its trip counts included
    launches: float


def _called(attributes: str, key: str) -> list[str]:
    match = re.search(key + r"=\{?([^}\s,]+(?:,\s*%?[\w.\-]+)*)\}?", attributes)
    if not match:
        return []
    return [name.strip().lstrip("%") for name in match.group(1).split(",")]


def _trip_count(attributes: str) -> int:
    match = re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes)
    return int(match.group(1)) if match else 1


def _kind(instruction: _Instruction, reduces: bool = False) -> str:
    """The class of a kernel; ``reduces``: a fusion whose results include a reduction."""
    opcode, attributes = instruction.opcode, instruction.attributes
    if _COMMUNICATION.match(opcode):
        return "communication"
    if opcode == "custom-call":
        if "fmha" in attributes or "cudnn$fmha" in attributes:
            return "attention"
        if "gemm" in attributes or "matmul" in attributes:
            return "matmul"
        return "elementwise"
    if opcode in ("dot", "convolution"):
        return "matmul"
    if opcode == "fusion":
        if "kind=kCustom" in attributes and ("gemm" in attributes or "dot" in attributes):
            return "matmul"
        if reduces:
            return "reduction"
    if opcode == "reduce":
        return "reduction"
    return "elementwise"


def _fusion_bytes(
    instruction: _Instruction, sizes: dict[str, int], fused: list[_Instruction]
) -> float:
    """A fusion's operands and results, less what it updates in place or slices."""
    read = [sizes.get(name, 0) for name in instruction.operands]
    written = shape_bytes(instruction.type)
    parameter = {inner.name: inner.index for inner in fused if inner.opcode == "parameter"}
    types = {inner.name: inner.type for inner in fused}
    users: dict[str, list[_Instruction]] = {}
    for inner in fused:
        for name in inner.operands:
            users.setdefault(name, []).append(inner)
    for name, source in parameter.items():
        if source is None or source >= len(read):
            continue
        readers = users.get(name, [])
        if readers and all(r.opcode in _TAKING_PARTS and r.operands[0] == name for r in readers):
            read[source] = min(read[source], sum(shape_bytes(r.type) for r in readers))
    for inner in fused:
        source = parameter.get(inner.operands[0]) if inner.operands else None
        if source is None or source >= len(read):
            continue
        if inner.opcode == "dynamic-update-slice" and inner.root and len(inner.operands) > 1:
            read[source] = 0
            written = shape_bytes(types.get(inner.operands[1], ""))
    return float(sum(read) + written)


# Ops that read a part of their first operand: the part's bytes.
_TAKING_PARTS = frozenset({"slice", "dynamic-slice", "gather"})


def _reduces(fused: list[_Instruction]) -> bool:
    """Whether a fused computation's results (its root, or a tuple's elements) include a
    reduction."""
    by_name = {inner.name: inner for inner in fused}
    roots = [inner for inner in fused if inner.root]
    for root in roots:
        results = (
            [by_name[n] for n in root.operands if n in by_name]
            if root.opcode == "tuple"
            else [root]
        )
        if any(result.opcode == "reduce" for result in results):
            return True
    return False


def kernels(text: str) -> list[Kernel]:
    """The kernels the module launches, with their bytes and how often each runs."""
    found, entry = computations(text)
    out: list[Kernel] = []

    def walk(computation: str, repeats: float) -> None:
        sizes = {i.name: shape_bytes(i.type) for i in found.get(computation, [])}
        for instruction in found.get(computation, []):
            opcode = instruction.opcode
            if opcode == "while":
                trips = _trip_count(instruction.attributes)
                for body in _called(instruction.attributes, "body"):
                    walk(body, repeats * trips)
                continue
            if opcode in ("conditional", "call", "async-start"):
                for key in ("branch_computations", "to_apply", "calls"):
                    for called in _called(instruction.attributes, key):
                        walk(called, repeats)
                continue
            if opcode in _NOT_KERNELS or opcode.endswith("-done"):
                continue
            fused = []
            if opcode == "fusion":
                fused = found.get(next(iter(_called(instruction.attributes, "calls")), ""), [])
                moved = _fusion_bytes(instruction, sizes, fused)
            else:
                moved = sum(sizes.get(n, 0) for n in instruction.operands)
                moved += shape_bytes(instruction.type)
            kind = _kind(instruction, _reduces(fused) if opcode == "fusion" else False)
            out.append(Kernel(instruction.name, kind, moved * repeats, repeats))

    walk(entry, 1.0)
    return out


def by_kind(found: list[Kernel]) -> dict[str, dict[str, float]]:
    """Kernels and bytes per class."""
    table: dict[str, dict[str, float]] = {}
    for kernel in found:
        row = table.setdefault(kernel.kind, {"kernels": 0.0, "bytes": 0.0})
        row["kernels"] += kernel.launches
        row["bytes"] += kernel.bytes
    return table


if __name__ == "__main__":  # python -m experiments.shared.hlo_kernels MODULE.hlo.txt
    import sys
    from pathlib import Path

    print(json.dumps(by_kind(kernels(Path(sys.argv[1]).read_text())), indent=2))
