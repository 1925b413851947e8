"""Expert placement for dropless routing, evaluated (:mod:`experiments.dropless_eval`'s
third part), and its section of the results file.

``tiny`` (8 experts, top-1, 8
devices, 2 expert slots per device: each device's own expert and one replica slot),
``--placement-steps`` steps of training each, static placement (every expert two
copies) against dynamic (re-planned after every step): in dropless mode (ragged) the
largest device load over the mean (``device_load``: the rows each device's slots took),
in capacity mode (1.25) the dropped fraction. Then the planner replayed on the static
runs' routing, with the routing predicted by its smoothed history, by the last step
alone, by the smoothed mean alone, and with hindsight (each step planned from its own
routing); a sweep of the history's constants (``SMOOTHING_GRID``); and how far the
routed loads persist from step to step. In dropless mode the placement changes only the
rounding of the step (the runs' routing drifts apart slowly), so the replays are what
those tables would have done; in capacity mode drops change training, so they replay the
static run's routing. The ratios' spread: the same ratio in each of ``PLACEMENT_BLOCKS``
blocks of the last half's steps. These runs deal an expert's rows round-robin over its
copies, the baseline: a research option (``ExperimentalOptions(replica_split=
"round_robin")`` of :mod:`jaxmoe.experimental`, passed to the run and to the replayed
planner: :func:`placement_options`); a third pair (``dropless_balanced``) splits them in
the step from its own counts, as the library does, replayed with the planner's prediction
and with hindsight. ``--placement-parts`` picks the pairs run (``PLACEMENT_PARTS``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.dropless_variants import BASELINE, PLACEMENT_TARGET, met, variant_config

PLACEMENT_SLOTS = 2  # expert slots per device in the placement runs
# The routing history's constants swept by the replays: (half-life in steps, last step's
# weight), as jaxmoe.placement.routing_history.SMOOTHING gives them.
SMOOTHING_HALF_LIVES = (8.0, 32.0, 128.0)
SMOOTHING_LATEST = (0.0, 0.5, 0.7, 0.8, 0.9, 1.0)
SMOOTHING_GRID = tuple((h, w) for h in SMOOTHING_HALF_LIVES for w in SMOOTHING_LATEST)
PLACEMENT_BLOCKS = 5  # the last half's steps in this many blocks, for the ratios' spread
PERSISTENCE_LAGS = (1, 5, 20)
REPLAYS = ("static", "smoothed", "last", "mean", "fitted", "hindsight")


def placement_config(steps: int, rebalance: int, dropless: bool):
    base = variant_config("tiny", "ragged dropless" if dropless else BASELINE, steps)
    moe = dataclasses.replace(base.moe, slots_per_device=PLACEMENT_SLOTS, rebalance_every=rebalance)
    return dataclasses.replace(base, moe=moe, train=dataclasses.replace(base.train, eval_batches=4))


def placement_options(dropless: bool, split: str):
    """The research options of a placement run: how the ragged dispatch splits an expert's
    rows over its copies (``split``; capacity mode has no such choice: the library's)."""
    from jaxmoe.experimental import DEFAULT, ExperimentalOptions

    return ExperimentalOptions(replica_split=split) if dropless else DEFAULT


def excess_load(loads: np.ndarray) -> float:
    """``loads [layers, devices]``: (largest over mean) - 1, averaged over the layers."""
    loads = np.asarray(loads, np.float64)
    return float(np.mean(loads.max(axis=1) / loads.mean(axis=1) - 1))


def _history(mode: str, smoothing: tuple[float, float] | None = None):
    """The planner's routing history for a replay ``mode``: ``smoothed`` (its own
    constants, or ``smoothing`` for both metrics), ``last`` (the last step alone),
    ``mean`` (the smoothed mean alone) or ``hindsight`` (a fresh one every step)."""
    from jaxmoe.placement.routing_history import SMOOTHING, RoutingHistory

    if mode == "smoothed" and smoothing is not None:
        return RoutingHistory({key: smoothing for key in SMOOTHING})
    if mode == "last":
        return RoutingHistory({key: (1.0, 1.0) for key in SMOOTHING})
    if mode == "mean":
        return RoutingHistory({key: (half_life, 0.0) for key, (half_life, _) in SMOOTHING.items()})
    return RoutingHistory()


def fitted_loads(rows: list[dict], start: int) -> np.ndarray:
    """``[steps - start, layers, experts]``: from step ``start`` on, each layer's routed
    loads as the least-squares affine function of the step before (every expert's load),
    fitted on those very steps: what the best one-step linear predictor could do, the fit
    made with hindsight."""
    load = np.asarray([row["tokens_per_expert"] for row in rows], np.float64)
    previous = load[start - 1 : -1]
    fitted = np.empty_like(load[start:])
    for layer in range(load.shape[1]):
        x = np.concatenate([previous[:, layer], np.ones((len(previous), 1))], axis=1)
        coefficients, *_ = np.linalg.lstsq(x, load[start:, layer], rcond=None)
        fitted[:, layer] = np.maximum(x @ coefficients, 0.0)
    return fitted


def replay(
    rows: list[dict],
    config,
    mode: str,
    smoothing: tuple[float, float] | None = None,
    experimental=None,
) -> list[float]:
    """The planner's tables (re-planned after every step) applied to the routing of
    ``rows``, per step: dropless, the device load's (max / mean) - 1; capacity, the dropped
    fraction (exact from ``kept_by_copies``). ``mode``, ``smoothing``: see ``_history``;
    mode ``static``: the initial table throughout; ``fitted`` (dropless): planned from
    ``fitted_loads`` over the last half (before it, from the last step). ``experimental``:
    the run's research options (:func:`placement_options`; None: the library's)."""
    from jaxmoe.experimental import DEFAULT
    from jaxmoe.placement.planner import device_loads, plan_placement
    from jaxmoe.placement.replicas import replicas_per_expert
    from jaxmoe.train.state import initial_placement

    experimental = DEFAULT if experimental is None else experimental

    def plan(table, window: list[dict], step: int, history):
        return plan_placement(table, window, config, step, history, experimental)[0]

    history = _history("last" if mode == "fitted" else mode, smoothing)
    half = len(rows) // 2
    fitted = fitted_loads(rows, half) if mode == "fitted" else None
    table = np.asarray(initial_placement(config))
    values = []
    for index, row in enumerate(rows):
        if mode == "static":
            pass
        elif mode == "hindsight":
            table = plan(table, [row], row["step"], _history(mode))
        elif fitted is not None and index >= half:
            predicted = {"step": row["step"], "tokens_per_expert": fitted[index - half]}
            table = plan(table, [predicted], row["step"], _history(mode))
        elif index:
            table = plan(table, [rows[index - 1]], row["step"], history)
        load = np.asarray(row["tokens_per_expert"], np.float64)  # [layers, experts]
        if config.moe.dropless:
            split = experimental.replica_split
            per_layer = [
                device_loads(table[layer], load[layer], split) for layer in range(len(load))
            ]
            values.append(excess_load(per_layer))
            continue
        kept = np.asarray(row["kept_by_copies"])  # [layers, experts, copies]
        copies = np.minimum(replicas_per_expert(table, config.moe.num_experts), kept.shape[2])
        total = np.take_along_axis(kept, copies[..., None] - 1, axis=2).sum()
        values.append(float(1 - total / load.sum()))
    return values


def persistence(rows: list[dict]) -> dict[str, float]:
    """How far each expert's share of the routed assignments persists: the correlation,
    over experts, layers and steps, of its deviation from its mean over ``rows`` with the
    deviation ``lag`` steps later, for each lag of ``PERSISTENCE_LAGS``."""
    load = np.asarray([row["tokens_per_expert"] for row in rows], np.float64)
    share = load / load.sum(axis=-1, keepdims=True)  # [steps, layers, experts]
    deviation = share - share.mean(axis=0)
    return {
        str(lag): float(np.corrcoef(deviation[:-lag].ravel(), deviation[lag:].ravel())[0, 1])
        for lag in PERSISTENCE_LAGS
    }


def _placement_series(rows: list[dict], dropless: bool) -> np.ndarray:
    """Per step: dropless, the device load's max/mean - 1; capacity, the dropped fraction."""
    if dropless:
        return np.array([excess_load(row["device_load"]) for row in rows])
    return np.array([row["dropped_fraction"] for row in rows])


def block_ratios(numerator: np.ndarray, denominator: np.ndarray) -> list[float]:
    """The ratio of the two series' means in each of ``PLACEMENT_BLOCKS`` blocks."""
    return [
        float(np.mean(n) / np.mean(d))
        for n, d in zip(
            np.array_split(numerator, PLACEMENT_BLOCKS),
            np.array_split(denominator, PLACEMENT_BLOCKS),
            strict=True,
        )
    ]


def measure_placement_mode(steps: int, dropless: bool, split: str = "round_robin") -> dict:
    """Static and dynamic runs of one mode, and the replays on the static run's routing
    (figures over the last half of the steps, and over the whole run). Under the balanced
    split only the planner's own prediction and hindsight are replayed."""
    from experiments.placement_eval import _run

    runs, applied = {}, 0
    options = placement_options(dropless, split)
    for label, rebalance in (("static", 0), ("dynamic", 1)):
        rows, decisions, seconds = _run(placement_config(steps, rebalance, dropless), options)
        runs[label] = rows
        applied += sum(bool(decision.get("applied")) for decision in decisions)
        print(f"placement, dropless {dropless}, {split}, {label}: {seconds:.0f} s", flush=True)
    static, dynamic = runs["static"], runs["dynamic"]
    config, half = placement_config(steps, 1, dropless), steps // 2
    measured = {label: _placement_series(rows, dropless) for label, rows in runs.items()}
    if split == "balanced":
        modes = ["static", "smoothed", "hindsight"]
    else:
        modes = [mode for mode in REPLAYS if dropless or mode != "fitted"]
    replays = {mode: np.array(replay(static, config, mode, experimental=options)) for mode in modes}
    entry = {
        "static": float(np.mean(measured["static"][half:])),
        "dynamic": float(np.mean(measured["dynamic"][half:])),
        "static_whole": float(np.mean(measured["static"])),
        "dynamic_whole": float(np.mean(measured["dynamic"])),
        "blocks": block_ratios(measured["dynamic"][half:], measured["static"][half:]),
        "changes_applied": applied,
        "largest_dropped": max(row["dropped_fraction"] for row in static + dynamic),
        "loss_static": float(np.mean([row["loss"] for row in static[-20:]])),
        "loss_dynamic": float(np.mean([row["loss"] for row in dynamic[-20:]])),
        "replay": {mode: float(np.mean(values[half:])) for mode, values in replays.items()},
        "replay_blocks": block_ratios(replays["smoothed"][half:], replays["static"][half:]),
    }
    if split == "balanced":
        return entry
    return {
        **entry,
        "sweep": [
            [h, w, float(np.mean(replay(static, config, "smoothed", (h, w), options)[half:]))]
            for h, w in SMOOTHING_GRID
        ],
        "persistence": persistence(static[half:]),
    }


# The placement runs: (dropless, how the ragged dispatch splits an expert's rows).
PLACEMENT_PARTS = {
    "dropless": (True, "round_robin"),
    "capacity": (False, "round_robin"),
    "dropless_balanced": (True, "balanced"),
}


def measure_placement(steps: int, parts: list[str]) -> dict:
    return {part: measure_placement_mode(steps, *PLACEMENT_PARTS[part]) for part in parts}


# --- The results file's section -------------------------------------------------------------


def _range(values: list[float]) -> str:
    return f"[{min(values):.3f}-{max(values):.3f}]"


def _replayed(entry: dict) -> float:
    return entry["replay"]["smoothed"] / entry["replay"]["static"]


def placement_lines(result: dict) -> list[str]:
    from jaxmoe.placement.routing_history import SMOOTHING

    p, steps = result["placement"], result["placement_steps"]
    d, c = p["dropless"], p["capacity"]
    half = steps // 2

    def ratio(entry: dict, key: str = "") -> float:
        return entry[f"dynamic{key}"] / entry[f"static{key}"]

    lines = [
        f"## Placement: `tiny`, {steps} steps, {PLACEMENT_SLOTS} slots per device, static "
        "against dynamic (re-planned after every step)",
        "",
        "8 experts, top-1, 8 devices: each device's own expert and one replica slot. Static: "
        "every expert two copies. Figures over the last half of the run (steps "
        f"{half}-{steps - 1}) unless they say otherwise; a ratio's range is its value in "
        f"each of {PLACEMENT_BLOCKS} blocks of those steps.",
        "",
        "| | static | dynamic | dynamic / static [range over blocks] |",
        "|---|---|---|---|",
        f"| dropless (ragged): device load max/mean - 1 | {d['static']:.4f} | "
        f"{d['dynamic']:.4f} | **{ratio(d):.3f}** {_range(d['blocks'])} |",
        f"| the same, whole run | {d['static_whole']:.4f} | {d['dynamic_whole']:.4f} | "
        f"{ratio(d, '_whole'):.3f} |",
        f"| dropless: largest dropped fraction of any step | {d['largest_dropped']:.4f} | | |",
        f"| dropless: loss, mean of the last 20 steps | {d['loss_static']:.4f} | "
        f"{d['loss_dynamic']:.4f} | |",
        f"| capacity 1.25: dropped fraction | {c['static']:.4f} | {c['dynamic']:.4f} | "
        f"**{ratio(c):.3f}** {_range(c['blocks'])} |",
        f"| the same, whole run | {c['static_whole']:.4f} | {c['dynamic_whole']:.4f} | "
        f"{ratio(c, '_whole'):.3f} |",
        f"| capacity 1.25: loss, mean of the last 20 steps | {c['loss_static']:.4f} | "
        f"{c['loss_dynamic']:.4f} | |",
        "",
        f"Targets (dynamic at most {PLACEMENT_TARGET}x static): dropless excess load "
        f"{ratio(d):.3f}x, {met(ratio(d), PLACEMENT_TARGET)}; capacity-mode drops "
        f"{ratio(c):.3f}x, {met(ratio(c), PLACEMENT_TARGET)}. On the same routing (the "
        f"replays below): {_replayed(d):.3f}x {_range(d['replay_blocks'])}, "
        f"{met(_replayed(d), PLACEMENT_TARGET)}, and {_replayed(c):.3f}x "
        f"{_range(c['replay_blocks'])}, {met(_replayed(c), PLACEMENT_TARGET)}.",
        "",
        "The planner replayed on the static runs' routing (re-planned after every step; "
        "last half; in parentheses, over the replayed static placement), the routing it "
        "plans from predicted in several ways. *Static, replayed*: the static table on "
        "that routing, which checks the replay against the run (dropless: each expert's "
        "rows split evenly over its copies; capacity: `kept_by_copies`, exact). *Linear, "
        "fitted with hindsight*: each layer's loads as the least-squares affine function of "
        "the step before, fitted on the very steps it predicts (an upper bound on any "
        "one-step linear predictor; dropless only):",
        "",
        "| | static, replayed | smoothed history (the planner: "
        f"{SMOOTHING['tokens_per_expert']}) | last step alone | smoothed mean alone "
        "| linear, fitted with hindsight | hindsight (each step's own routing) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, entry in (("dropless: device load max/mean - 1", d), ("capacity: dropped", c)):
        r = entry["replay"]
        cells = [
            f"{r[mode]:.4f} ({r[mode] / r['static']:.3f}x)" if mode in r else "-"
            for mode in REPLAYS[1:]
        ]
        lines.append(f"| {label} | {r['static']:.4f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The history's constants swept, replayed as above (rows: the half-life in steps; "
        "columns: the last step's weight; the smallest in bold):",
        "",
        "| | half-life | " + " | ".join(f"{w:g}" for w in SMOOTHING_LATEST) + " |",
        "|---|---|" + "---|" * len(SMOOTHING_LATEST),
    ]
    for label, entry in (("dropless: max/mean - 1", d), ("capacity: dropped", c)):
        values = {(h, w): value for h, w, value in entry["sweep"]}
        best = min(values.values())
        for h in SMOOTHING_HALF_LIVES:
            cells = [
                f"**{values[h, w]:.4f}**" if values[h, w] == best else f"{values[h, w]:.4f}"
                for w in SMOOTHING_LATEST
            ]
            lines.append(f"| {label} | {h:g} | " + " | ".join(cells) + " |")
    lags = list(d["persistence"])
    lines += [
        "",
        "Persistence of the routed loads (static runs, last half): the correlation of each "
        "expert's share's deviation from its mean with the same deviation later:",
        "",
        "| | " + " | ".join(f"{lag} step{'s' if lag != '1' else ''} later" for lag in lags) + " |",
        "|---|" + "---|" * len(lags),
    ]
    for label, entry in (("dropless", d), ("capacity 1.25", c)):
        values = " | ".join(f"{entry['persistence'][lag]:.3f}" for lag in lags)
        lines.append(f"| {label} | {values} |")
    lines += ["", *_placement_reading(d, c)]
    if "dropless_balanced" in p:
        lines += ["", *_balanced_split_lines(d, p["dropless_balanced"])]
    return lines


def _balanced_split_lines(d: dict, b: dict) -> list[str]:
    """The runs whose step splits each expert's rows over its copies from its own counts,
    beside the round-robin runs ``d``."""
    rr, rb = d["static"], b["replay"]
    rows = [
        ("static table, rows dealt round-robin (above)", rr, ""),
        ("dynamic table, rows dealt round-robin (above)", d["dynamic"], _range(d["blocks"])),
        ("static table, balanced split", b["static"], ""),
        ("dynamic table, balanced split", b["dynamic"], ""),
    ]
    lines = [
        "### The step's own split (balanced, the library's)",
        "",
        "The same dropless runs with the ragged dispatch splitting each expert's rows over "
        "its copies inside the step, from that step's routed counts "
        "(`jaxmoe/placement/copy_split.py`); the planner judges its tables under that split "
        "over the last steps' routing. Last half of each run; the range over blocks is "
        "that of dynamic over static within a pair of runs.",
        "",
        "| dropless: device load max/mean - 1 | value | / static, round-robin |",
        "|---|---|---|",
        *(
            f"| {label} | {value:.4f} | {value / rr:.3f} {spread} |"
            for label, value, spread in rows
        ),
        f"| dynamic over static, both balanced | | {b['dynamic'] / b['static']:.3f} "
        f"{_range(b['blocks'])} |",
        f"| the same, whole run: static, dynamic | {b['static_whole']:.4f}, "
        f"{b['dynamic_whole']:.4f} | {b['static_whole'] / d['static_whole']:.3f}, "
        f"{b['dynamic_whole'] / d['static_whole']:.3f} |",
        f"| largest dropped fraction of any step | {b['largest_dropped']:.4f} | |",
        f"| loss, mean of the last 20 steps: static, dynamic | {b['loss_static']:.4f}, "
        f"{b['loss_dynamic']:.4f} | |",
        "",
        "Replayed on the balanced static run's routing (as above; the planner's tables "
        "under the balanced split): static table "
        f"{rb['static']:.4f}, the planner's {rb['smoothed']:.4f} "
        f"({rb['smoothed'] / rb['static']:.3f}x), planned from each step's own routing "
        f"{rb['hindsight']:.4f} ({rb['hindsight'] / rb['static']:.3f}x).",
        "",
        f"Target (the static excess load at most {PLACEMENT_TARGET}x): placement with the "
        f"step's own split leaves {b['dynamic'] / rr:.3f}x the excess load of static "
        f"placement dealt round-robin, {met(b['dynamic'] / rr, PLACEMENT_TARGET)}; the "
        f"static table alone under the split {b['static'] / rr:.3f}x. Between tables, under "
        f"the split, dynamic over static is {b['dynamic'] / b['static']:.3f}x "
        f"{_range(b['blocks'])}.",
        "",
        "Reading. The split is the choice made within the step that the replays above point "
        "to: it follows each step's own routing, which no table made before the step can. "
        "On the static table (every expert two copies, each device sharing with the next) "
        f"it leaves {b['static']:.4f} of excess load over the last half; what remains is "
        "steps whose hot experts hold more rows than the devices of their copies can take "
        f"at the mean (the whole run's {b['static_whole']:.4f} is mostly the first steps, "
        "whose routing is far more skewed). The planner, judging tables under the split "
        "over the last steps' routing, keeps the spread table on this routing (replayed: "
        f"{rb['smoothed'] / rb['static']:.3f}x); a table chosen from each step's own "
        f"routing would reach {rb['hindsight'] / rb['static']:.3f}x of it, the part of "
        "the routing that the steps before do not predict.",
    ]
    return lines


def _placement_reading(d: dict, c: dict) -> list[str]:
    """Why the placement figures are what they are, each statement read off them."""
    from jaxmoe.placement.routing_history import SMOOTHING

    rd, rc = d["replay"], c["replay"]
    hindsight_d = rd["hindsight"] / rd["static"]
    hindsight_c = rc["hindsight"] / rc["static"]
    best_sweep = min(d["sweep"], key=lambda entry: entry[2])
    blended = [value / rd["static"] for _, w, value in d["sweep"] if 0 < w < 1]
    inside = min(d["replay_blocks"]) <= min(blended) and max(blended) <= max(d["replay_blocks"])
    return [
        f"Reading, dropless. The planner places the copies before a step, from the steps "
        f"before it; an expert's share of the routing correlates {d['persistence']['1']:.2f} "
        f"with the next step's and {d['persistence']['5']:.2f} with the step five later. "
        f"Planned from each step's own routing the excess load would be {hindsight_d:.3f}x "
        f"static's; planned from the planner's prediction it is {_replayed(d):.3f}x on the "
        f"same routing ({d['dynamic'] / d['static']:.3f}x in the dynamic run, whose routing "
        "drifts from the static run's by rounding), from the last step alone "
        f"{rd['last'] / rd['static']:.3f}x, from the mean alone {rd['mean'] / rd['static']:.3f}x, "
        f"with the best constants of the sweep ({best_sweep[0]:g}, {best_sweep[1]:g}) "
        f"{best_sweep[2] / rd['static']:.3f}x, and from a linear predictor fitted with "
        f"hindsight on the very steps it predicts {rd['fitted'] / rd['static']:.3f}x. What "
        "separates the planner from hindsight is the part of each step's routing that the "
        "steps before it do not predict, not the planning: a table made before the step "
        "cannot follow it, and only a choice made within the step from that step's counts "
        "(which the ragged dispatch all-gathers before its exchange), such as how each "
        "expert's rows split over its copies, could reach towards the hindsight figure "
        "(the next section). "
        f"The blends of the sweep (weights strictly between 0 and 1) span {min(blended):.3f}x"
        f"-{max(blended):.3f}x, {'inside' if inside else 'not inside'} the planner's own "
        f"range over blocks {_range(d['replay_blocks'])}; the planner keeps its constants "
        f"{SMOOTHING['tokens_per_expert']}.",
        "",
        f"Reading, capacity 1.25. Planned with each step's own routing, placement would drop "
        f"{hindsight_c:.3f}x static's assignments; the planner's prediction gets "
        f"{_replayed(c):.3f}x on the same routing. A copy adds its places to every routing "
        "group alike, while drops come from groups (one sequence each) in which an expert "
        "gets more assignments than its places, and no table of copies follows those: with "
        "hindsight of every step's routing, placement still does not halve the drops here.",
        "",
    ]
