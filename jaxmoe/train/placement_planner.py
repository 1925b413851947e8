"""The placement planner: where the replica slots' copies go, from live routing counts.

Every ``moe.rebalance_every`` steps the loop hands the planner the metrics of the
window just ended. The step measures, per MoE layer, how many assignments each
expert would have kept with 1, 2, ... copies (``kept_by_copies``: an expert keeps
its first ``copies * capacity`` assignments of each routing group, whatever the
other experts do). From these the planner, as FlexMoE does, weighs each
candidate change's gain against its cost and applies only the changes that pay
back within the next window:

- *replicate* expert ``e`` into a replica slot: the assignments its next copy
  keeps. The slot is an empty one, or one whose copy of another expert is worth
  least (*drop* a replica: the assignments that expert's last copy kept). A pair
  is applied when its net gain is positive and pays back.
- *move* a copy between devices (swap two replica slots of the most and least
  loaded devices) when it lowers the largest per-device load: on backends with
  ragged exchanges that load is the slowest device's expert compute.

Units. A kept assignment is valued at the link time of the all-to-all bytes it
carries (dispatch and return, forward and backward), the traffic that raising
the capacity would add to keep it; a move's device-load gain at the expert
FLOPs it takes off the slowest device, both over the cost model's device
(``schedule.profile``, ``schedule.link_mbit``). A change costs the
bytes it moves over that link (``PlanCosts.slot_write_bytes`` per slot written).
Here that is nothing: a replica's weights are gathered from its home shard in
every step (:mod:`jaxmoe.parallel.placement`), a standing cost of every run with
replica slots that no change adds to. A placement that stores its replicas, as
FlexMoE's does, would set it to an expert's parameter bytes, and then only
changes whose gain over the window exceeds the transfer are made.

Each decision (applied or, when nothing pays back, the best candidate refused)
is one line of ``placement.jsonl`` under ``--out``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import scheduling
from jaxmoe.config import Config
from jaxmoe.parallel.placement import EMPTY, replicas_per_expert

PLACEMENT_FILE = "placement.jsonl"


@dataclass(frozen=True)
class PlanCosts:
    """What the planner's estimates are made of, from the config and the cost model."""

    # Bytes a change moves per slot it writes, beyond the step's own traffic: none here,
    # since the step gathers every replica from its home shard anyway.
    slot_write_bytes: int
    assignment_bytes: int  # all-to-all bytes one kept assignment carries
    assignment_flops: float  # expert FLOPs of one assignment, forward and backward
    link_bytes_per_s: float
    link_latency_s: float
    flops_per_s: float

    @classmethod
    def of(cls, config: Config) -> PlanCosts:
        model, moe = config.model, config.moe
        profile = scheduling.PROFILES[config.schedule.profile]
        if config.schedule.link_mbit:
            profile = profile.with_link(config.schedule.link_mbit * 1e6 / 8)
        hidden = moe.d_expert or model.d_ff
        width_bytes = model.d_model * (2 if model.dtype == "bfloat16" else 4)
        return cls(
            slot_write_bytes=0,
            assignment_bytes=4 * width_bytes,
            assignment_flops=3 * 4 * model.d_model * hidden,
            link_bytes_per_s=profile.link_bytes_per_s,
            link_latency_s=profile.link_latency_s,
            flops_per_s=profile.flops_per_s,
        )

    def transfer_s(self, slots_written: int) -> float:
        if not self.slot_write_bytes:
            return 0.0
        return slots_written * (self.slot_write_bytes / self.link_bytes_per_s + self.link_latency_s)


def _halves_mean(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    """Mean per step of a metric over each half of the window: ``[2, ...]`` (one row for a
    window of one step)."""
    values = np.asarray([row[key] for row in rows], np.float64)
    return np.stack([part.mean(axis=0) for part in np.array_split(values, min(2, len(values)))])


class _LayerPlan:
    """The greedy plan of one MoE layer; ``table`` is changed in place.

    ``kept_by_copies[h, e, n - 1]``: assignments per step expert ``e`` keeps with
    ``n`` copies, measured in half ``h`` of the window for every ``n`` (each copy adds
    ``capacity`` places per group; an expert keeps its first ``n * capacity``
    assignments of a group whatever the other experts do). Routing drifts, so a copy's
    gain is the smaller of the two halves' and a dropped copy's loss the larger: a
    change must pay in both. The marginal gains fall with ``n``, so the greedy exchange
    of one copy at a time ends at the best allocation the estimates allow.
    """

    def __init__(self, table: np.ndarray, kept_by_copies: np.ndarray):
        self.table, self.kept_by_copies = table, kept_by_copies
        self.expert_axis, self.spare = table.shape
        self.num_experts = kept_by_copies.shape[1]
        self.local = self.num_experts // self.expert_axis

    def copies(self) -> np.ndarray:
        return replicas_per_expert(self.table, self.num_experts)

    def kept(self, expert: int, copies: int) -> np.ndarray:
        """Per half of the window."""
        if copies == 0:
            return np.zeros(self.kept_by_copies.shape[0])
        return self.kept_by_copies[:, expert, min(copies, self.kept_by_copies.shape[2]) - 1]

    def gain_of_copy(self, expert: int, copies: np.ndarray) -> float:
        gains = self.kept(expert, copies[expert] + 1) - self.kept(expert, copies[expert])
        return float(gains.min())

    def loss_of_dropping(self, expert: int, copies: np.ndarray) -> float:
        losses = self.kept(expert, copies[expert]) - self.kept(expert, copies[expert] - 1)
        return float(losses.max())

    def per_copy_load(self) -> np.ndarray:
        copies = self.copies()
        return np.array(
            [self.kept(e, copies[e]).mean() / copies[e] for e in range(self.num_experts)]
        )

    def device_loads(self) -> np.ndarray:
        per_copy = self.per_copy_load()
        home = per_copy.reshape(self.expert_axis, self.local).sum(axis=1)
        replicas = np.where(self.table >= 0, per_copy[np.maximum(self.table, 0)], 0.0)
        return home + replicas.sum(axis=1)

    def best_reassignment(self) -> tuple[float, tuple[int, int], int, float] | None:
        """(net gain per step, donor slot, recipient expert, its loss) of the best pair."""
        copies = self.copies()
        gains = [self.gain_of_copy(e, copies) for e in range(self.num_experts)]
        best = None
        for device, slot in np.ndindex(self.table.shape):
            held = int(self.table[device, slot])
            loss = 0.0 if held == EMPTY else self.loss_of_dropping(held, copies)
            for expert in range(self.num_experts):
                if expert != held and (best is None or gains[expert] - loss > best[0]):
                    best = (gains[expert] - loss, (device, slot), expert, loss)
        return best

    def best_move(self) -> tuple[float, tuple[int, int], tuple[int, int]] | None:
        """(lower largest device load per step, slot a, slot b) of the best swap."""
        loads = self.device_loads()
        busiest, idlest = int(np.argmax(loads)), int(np.argmin(loads))
        if busiest == idlest:
            return None
        per_copy = self.per_copy_load()

        def load(expert: int) -> float:
            return 0.0 if expert == EMPTY else float(per_copy[expert])

        best = None
        for slot_a in range(self.spare):
            for slot_b in range(self.spare):
                shift = load(self.table[busiest, slot_a]) - load(self.table[idlest, slot_b])
                new_max = max(loads[busiest] - shift, loads[idlest] + shift)
                lowered = loads[busiest] - new_max
                if lowered > 1e-9 and (best is None or lowered > best[0]):
                    best = (lowered, (busiest, slot_a), (idlest, slot_b))
        return best


def plan_placement(
    placement: np.ndarray, rows: list[dict[str, Any]], config: Config, step: int
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The new replica tables ``[moe_layers, expert_axis, replica_slots]`` after the window
    ``rows`` (metrics of its steps), and the decisions taken (see the module docstring)."""
    costs = PlanCosts.of(config)
    window = config.moe.rebalance_every
    # [halves, moe_layers, experts, copies]
    kept_by_copies = _halves_mean(rows, "kept_by_copies")
    tables = np.array(placement, np.int32, copy=True)
    decisions: list[dict[str, Any]] = []
    value_s = costs.assignment_bytes / costs.link_bytes_per_s  # of one kept assignment
    for layer in range(tables.shape[0]):
        plan = _LayerPlan(tables[layer], kept_by_copies[:, layer])
        refused = None
        for _ in range(plan.table.size):
            best = plan.best_reassignment()
            if best is None:
                break
            net, (device, slot), expert, loss = best
            held = int(plan.table[device, slot])
            record = {
                "step": step,
                "layer": layer,
                "change": "replicate",
                "expert": expert,
                "device": device,
                "slot": slot,
                "replaces": held,
                "gain_assignments": net * window,
                "gain_s": net * window * value_s,
                "cost_bytes": costs.slot_write_bytes,
                "cost_s": costs.transfer_s(1),
            }
            if net <= 0 or record["gain_s"] <= record["cost_s"]:
                refused = record
                break
            if held != EMPTY:
                decisions.append(
                    {
                        **record,
                        "change": "drop",
                        "expert": held,
                        "replaces": None,
                        "gain_assignments": -loss * window,
                        "gain_s": -loss * window * value_s,
                        "cost_bytes": 0,
                        "cost_s": 0.0,
                        "applied": True,
                    }
                )
            plan.table[device, slot] = expert
            decisions.append({**record, "applied": True})
        for _ in range(plan.expert_axis):
            move = plan.best_move()
            if move is None:
                break
            lowered, slot_a, slot_b = move
            saved = lowered * window * costs.assignment_flops
            record = {
                "step": step,
                "layer": layer,
                "change": "move",
                "expert": int(plan.table[slot_a]),
                "from_device": slot_a[0],
                "device": slot_b[0],
                "swapped_with": int(plan.table[slot_b]),
                "gain_device_load": lowered * window,
                "gain_s": saved / costs.flops_per_s,
                "cost_bytes": 2 * costs.slot_write_bytes,
                "cost_s": costs.transfer_s(2),
            }
            if record["gain_s"] <= record["cost_s"]:
                break
            plan.table[slot_a], plan.table[slot_b] = plan.table[slot_b], plan.table[slot_a]
            decisions.append({**record, "applied": True})
        if refused is not None and not any(d["layer"] == layer for d in decisions):
            decisions.append({**refused, "applied": False})
    return tables, decisions


class PlacementLog:
    """``placement.jsonl``: one line per decision (process 0 only). A resumed run keeps the
    lines of the steps before ``first_step``."""

    def __init__(self, out_dir: str | Path | None, first_step: int, active: bool):
        self.path = None if out_dir is None or not active else Path(out_dir) / PLACEMENT_FILE
        if self.path is None:
            return
        kept = []
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            kept = [line for line in lines if line and json.loads(line)["step"] <= first_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, decisions: list[dict[str, Any]]) -> None:
        if self.path is None or not decisions:
            return
        with self.path.open("a") as file:
            file.write("".join(json.dumps(decision) + "\n" for decision in decisions))
