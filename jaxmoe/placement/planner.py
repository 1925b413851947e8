"""The placement planner: where the replica slots' copies go, from live routing counts.

Every ``moe.rebalance_every`` steps the loop hands the planner the metrics of the
window just ended. The planner folds them into a smoothed routing history
(:class:`~jaxmoe.placement.routing_history.RoutingHistory`) and plans from its prediction of
the next steps: the last step blended with an exponentially weighted mean
(``SMOOTHING``), so that one step's burst does not move the copies as far as it would
alone. What it optimises depends on the routing.

**Capacity mode** (``moe.capacity_factor`` set): fewer dropped assignments. The step
measures, per MoE layer, how many assignments each expert would have kept with 1, 2, ...
copies (``kept_by_copies``: an expert keeps its first ``copies * capacity`` assignments of
each routing group, whatever the other experts do). From these the planner, as FlexMoE
does, weighs each candidate change's gain against its cost and applies only the changes
that pay back within the next window:

- *replicate* expert ``e`` into a replica slot: the assignments its next copy
  keeps. The slot is an empty one, or one whose copy of another expert is worth
  least (*drop* a replica: the assignments that expert's last copy kept). A pair
  is applied when its net gain is positive and pays back.
- *move* a copy between devices (swap two replica slots of the most and least
  loaded devices) when it lowers the largest per-device load: on backends with
  ragged exchanges that load is the slowest device's expert compute.

The gains are those of the predicted next steps (``kept_by_copies`` as
:class:`RoutingHistory` predicts it).

**Dropless mode**: nothing drops, so what placement changes is the slowest device's
expert load (rows received and multiplied: with the ragged dispatch, the step time of the
busiest device). How a device's load follows from a table depends on how the step splits
an expert's rows over its copies (:func:`device_loads`): ``balanced``, the library's, or
``round_robin``, the research baseline (``ExperimentalOptions.replica_split``,
:mod:`jaxmoe.experimental`; the padded dispatch always deals them round-robin):

- ``round_robin``: evenly (each source deals them out), so a device's load is the sum of
  its copies' shares. From the predicted routed counts (``tokens_per_expert``) the planner
  gives the replica slots, one at a time, to the expert with the largest load per copy (at
  most one copy per device), places those copies largest first on the least loaded device
  that has a free slot and no copy of that expert (home experts stay where they are),
  keeps copies in the slots they already hold, then, from that table or the current one
  (whichever is better), makes the single-slot change that most lowers the largest device
  load (then the spread of the others) until none does, and applies the result when it
  lowers the largest device load (``place``).
- ``balanced``: the step balances each step's rows over the copies itself
  (:mod:`jaxmoe.placement.copy_split`), so what a table decides is which devices can take
  over each other's rows. The table stays unless the one above, or the static spread of
  copies (:func:`~jaxmoe.placement.replicas.static_placement`), gives a lower largest load
  under that split, averaged over the routing of the last ``RECENT_STEPS`` steps
  (:mod:`jaxmoe.placement.routing_history`): a table tuned to one prediction of the routing
  can balance the steps around it worse than a spread one, whose copies link every device
  to others.

Units. A kept assignment is valued at the link time of the all-to-all bytes it
carries (dispatch and return, forward and backward), the traffic that raising
the capacity would add to keep it; a lower device load at the expert FLOPs it takes off
the slowest device, both over the cost model's device (``schedule.profile`` and its
link). A change costs the bytes it moves over that link
(``PlanCosts.slot_write_bytes`` per slot written). Here that is nothing: a replica's
weights are gathered from its home shard in every step (:mod:`jaxmoe.placement.replicas`),
a standing cost of every run with replica slots that no change adds to. A placement that
stores its replicas, as FlexMoE's does, would set it to an expert's parameter bytes, and
then only changes whose gain over the window exceeds the transfer are made.

Each decision (applied or, when nothing pays back, the best candidate refused)
is one line of ``placement.jsonl`` under ``--out``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxmoe.config import Config
from jaxmoe.experimental import DEFAULT, ExperimentalOptions
from jaxmoe.placement.copy_split import balanced_rows
from jaxmoe.placement.replicas import EMPTY, replicas_per_expert, static_placement
from jaxmoe.placement.routing_history import RoutingHistory

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
        profile = config.schedule.device_profile
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


# A new dropless table must lower the largest device load by more than this (relative to
# the mean load): smaller gains are noise, and moving copies for them churns the table.
MIN_LOAD_GAIN = 0.005

# The planner's own histories, one per configuration, for callers that pass none.
_HISTORIES: dict[Config, RoutingHistory] = {}
_MAX_HISTORIES = 8


def _history_for(config: Config) -> RoutingHistory:
    if config not in _HISTORIES:
        while len(_HISTORIES) >= _MAX_HISTORIES:
            _HISTORIES.pop(next(iter(_HISTORIES)))
        _HISTORIES[config] = RoutingHistory()
    return _HISTORIES[config]


class _LayerPlan:
    """The greedy plan of one MoE layer in capacity mode; ``table`` is changed in place.

    ``kept_by_copies[h, e, n - 1]``: assignments per step expert ``e`` keeps with
    ``n`` copies, for every ``n`` (each copy adds ``capacity`` places per group; an
    expert keeps its first ``n * capacity`` assignments of a group whatever the other
    experts do), under each estimate ``h`` of the routing (the planner passes one, the
    prediction). With several, a copy's gain is the smallest and a dropped copy's loss the
    largest: a change must pay under all. The marginal gains fall with ``n``, so the
    greedy exchange of one copy at a time ends at the best allocation the estimates
    allow.
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


def copy_loads(table: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Each expert's load per copy under ``table`` (``[expert_axis, replica_slots]``)."""
    return load / replicas_per_expert(table, load.shape[0])


def device_loads(table: np.ndarray, load: np.ndarray, split: str = "round_robin") -> np.ndarray:
    """``[expert_axis]``: the routed assignments each device's slots take under ``table``
    when expert ``e`` has ``load[e]`` (ragged dropless), its copies sharing it as the step
    splits it: evenly (``round_robin``) or ``balanced`` (then ``load [..., E]`` may hold
    several routings: ``[..., expert_axis]``)."""
    if split == "balanced":  # load [..., E]: several routings at once
        expert_axis, spare = table.shape
        home = np.arange(load.shape[-1]).reshape(expert_axis, -1)
        slot_expert = np.concatenate([home, table], axis=1).reshape(-1)
        slots = home.shape[1] + spare
        rows = balanced_rows(load, slot_expert, slots)
        return rows.reshape(*load.shape[:-1], expert_axis, slots).sum(axis=-1)
    per_copy = copy_loads(table, load)
    expert_axis = table.shape[0]
    home = per_copy.reshape(expert_axis, -1).sum(axis=1)
    replicas = np.where(table >= 0, per_copy[np.maximum(table, 0)], 0.0)
    return home + replicas.sum(axis=1)


def _score(table: np.ndarray, load: np.ndarray) -> tuple[float, float]:
    """What balancing minimises: the largest device load, then the sum of squared loads
    (which moves the other devices of a tie towards the mean)."""
    loads = device_loads(table, load)
    return float(loads.max()), float(np.sum(loads**2))


def _improve(table: np.ndarray, load: np.ndarray, local: int) -> np.ndarray:
    """Local search from ``table``: the best single-slot change that lowers the score,
    until none does. A change either gives a replica slot of the busiest device to
    another expert, or writes a copy of one of its experts into another device's slot."""
    table = table.copy()
    expert_axis, spare = table.shape
    num_experts = load.shape[0]
    best = _score(table, load)
    for _ in range(4 * table.size + num_experts):
        busiest = int(np.argmax(device_loads(table, load)))
        held = set(range(busiest * local, (busiest + 1) * local)) | set(table[busiest].tolist())
        candidates = [
            (busiest, slot, expert)
            for slot in range(spare)
            for expert in range(num_experts)
            if expert not in held
        ]
        for expert in sorted(e for e in held if e >= 0):
            for device in range(expert_axis):
                home = set(range(device * local, (device + 1) * local))
                if device != busiest and expert not in home and expert not in table[device]:
                    candidates += [(device, slot, expert) for slot in range(spare)]
        chosen = None
        for device, slot, expert in candidates:
            previous = table[device, slot]
            table[device, slot] = expert
            score = _score(table, load)
            table[device, slot] = previous
            if score < best and (chosen is None or score < chosen[0]):
                chosen = (score, device, slot, expert)
        if chosen is None:
            break
        best, device, slot, expert = chosen
        table[device, slot] = expert
    return table


def balanced_table(table: np.ndarray, load: np.ndarray) -> np.ndarray:
    """A replica table that spreads ``load`` (per expert) evenly over the devices, starting
    from ``table`` (whose copies stay in their slots where they are placed again; see the
    module docstring, dropless mode)."""
    expert_axis, spare = table.shape
    num_experts = load.shape[0]
    local = num_experts // expert_axis
    copies = np.ones(num_experts, np.int64)
    for _ in range(table.size):
        per_copy = np.where(copies < expert_axis, load / copies, -np.inf)
        expert = int(np.argmax(per_copy))
        if not per_copy[expert] > 0:
            break
        copies[expert] += 1
    holds = [set(range(d * local, (d + 1) * local)) for d in range(expert_axis)]
    loads = np.array([sum(load[e] / copies[e] for e in held) for held in holds])
    placed: list[list[int]] = [[] for _ in range(expert_axis)]
    extra = [(load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e] - 1)]
    for share, expert in sorted(extra, key=lambda item: (-item[0], item[1])):
        free = [d for d in range(expert_axis) if len(placed[d]) < spare and expert not in holds[d]]
        if not free:
            continue  # every device with room holds it already: one copy fewer
        device = min(free, key=lambda d: (loads[d], d))
        placed[device].append(expert)
        holds[device].add(expert)
        loads[device] += share
    packed = np.full_like(table, EMPTY)
    for device, experts in enumerate(placed):
        kept = [slot for slot in range(spare) if table[device, slot] in experts]
        for slot in kept:
            packed[device, slot] = table[device, slot]
        rest = [e for e in experts if e not in set(table[device, kept].tolist())]
        free_slots = [slot for slot in range(spare) if slot not in kept]
        for slot, expert in zip(free_slots, rest, strict=False):
            packed[device, slot] = expert
    start = min((table, packed), key=lambda t: _score(t, load))
    return _improve(start, load, local)


def _plan_dropless(
    tables: np.ndarray,
    history: RoutingHistory,
    config: Config,
    step: int,
    costs: PlanCosts,
    split: str,
) -> list[dict[str, Any]]:
    """Dropless mode: each layer's table re-placed for an even device load (in place),
    judged under the step's ``split`` of an expert's rows over its copies."""
    window = config.moe.rebalance_every
    loads = history.predict("tokens_per_expert")  # [moe_layers, experts]
    # Under the balanced split, tables are judged on these: [steps, moe_layers, experts].
    recent = history.recent("tokens_per_expert") if split == "balanced" else None
    decisions = []
    for layer in range(tables.shape[0]):
        load, table = loads[layer], tables[layer]
        mean = load.sum() / table.shape[0]
        if not mean > 0:
            continue
        if split == "balanced":

            def largest(candidate: np.ndarray, layer: int = layer) -> float:
                loads = device_loads(candidate, recent[:, layer], split)  # [steps, devices]
                return float(np.mean(loads.max(axis=-1)))

            mean = recent[:, layer].sum(axis=1).mean() / table.shape[0]
            expert_axis, spare = table.shape
            slots = load.shape[0] // expert_axis + spare
            spread = static_placement(load.shape[0], expert_axis, slots)
            candidate = min((balanced_table(table, load), spread), key=largest)
        else:

            def largest(candidate: np.ndarray, load: np.ndarray = load) -> float:
                return float(device_loads(candidate, load).max())

            candidate = balanced_table(table, load)
        before, after = largest(table), largest(candidate)
        written = int(np.sum(candidate != table))
        record = {
            "step": step,
            "layer": layer,
            "change": "place",
            "slots_written": written,
            "max_over_mean_before": float(before / mean),
            "max_over_mean_after": float(after / mean),
            "gain_device_load": float(before - after) * window,
            "gain_s": float(before - after) * window * costs.assignment_flops / costs.flops_per_s,
            "cost_bytes": written * costs.slot_write_bytes,
            "cost_s": costs.transfer_s(written),
        }
        if not written:
            continue
        applied = before - after > MIN_LOAD_GAIN * mean and record["gain_s"] > record["cost_s"]
        if applied:
            tables[layer] = candidate
        decisions.append({**record, "applied": bool(applied)})
    return decisions


def plan_placement(
    placement: np.ndarray,
    rows: list[dict[str, Any]],
    config: Config,
    step: int,
    history: RoutingHistory | None = None,
    experimental: ExperimentalOptions = DEFAULT,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The new replica tables ``[moe_layers, expert_axis, replica_slots]`` after the window
    ``rows`` (metrics of its steps), and the decisions taken (see the module docstring).

    ``history``: the run's smoothed routing (:attr:`PlacementLog.history`), which ``rows``
    are folded into; None: the planner's own for ``config`` (one per configuration in this
    process, started again when a window starts before the last step it saw).
    ``experimental``: the run's research options (``Run.experimental``): the ragged
    dispatch's split of an expert's rows over its copies."""
    costs = PlanCosts.of(config)
    window = config.moe.rebalance_every
    history = _history_for(config) if history is None else history
    history.update(rows)
    tables = np.array(placement, np.int32, copy=True)
    if config.moe.dropless:
        ragged = config.moe.dropless_dispatch == "ragged"
        split = experimental.replica_split if ragged else "round_robin"
        return tables, _plan_dropless(tables, history, config, step, costs, split)
    kept_by_copies = history.predict("kept_by_copies")[None]  # [1, layers, experts, copies]
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
    lines of the steps before ``first_step``. Also holds the run's routing history."""

    def __init__(self, out_dir: str | Path | None, first_step: int, active: bool):
        # The run's smoothed routing, for plan_placement(history=...); every process
        # keeps one (they all plan), whether or not it writes the log.
        self.history = RoutingHistory()
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
