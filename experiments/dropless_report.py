"""The dropless evaluation's results file (:mod:`experiments.dropless_eval`): its tables
and readings, written from the measured figures (or from a saved JSON of them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from experiments.dropless_placement import placement_lines
from experiments.dropless_variants import (
    BASELINE,
    BYTES_TARGET,
    PRESETS,
    SOCKET_HOSTS,
    WARMUP,
    met,
)


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def _kib_counts(dispatch: dict) -> str:
    counts = [dispatch[name]["ragged dropless"]["count_bytes"] for name in dispatch]
    return " and ".join(f"{value / 2**10:.2f} KiB" for value in counts)


def _ratios(values: list[float], baseline: list[float]):
    from experiments.shared.spread import Spread, round_ratios

    return Spread.of(round_ratios(values, baseline))


def _dispatch_tables(name: str, results: dict) -> list[str]:
    from experiments.shared.spread import Spread

    base = results[BASELINE]
    lines = [
        f"### `{name}`",
        "",
        "| variant | all-to-all operands (MiB) | moved by `ragged_all_to_all` (MiB) "
        "| / capacity 1.25 | expert GFLOPs: grouped GEMM | expert GFLOPs: XLA:CPU "
        "| compiled step GFLOPs | dropped | max/mean device load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        lines.append(
            f"| {variant} | {_mib(r['a2a_bytes'])} | {_mib(r['routed_bytes'])} | "
            f"{r['routed_bytes'] / base['routed_bytes']:.3f} | "
            f"{r['expert_flops_gemm'] / 1e9:.3f} | {r['expert_flops_cpu'] / 1e9:.3f} | "
            f"{r['compiled_flops'] / 1e9:.2f} | {r['dropped_fraction']:.4f} | "
            f"{r['max_over_mean_load']:.3f} |"
        )
    lines += [
        "",
        "| variant | step (ms), median [range] | / capacity 1.25, per round "
        "| temp (MiB) | arguments + outputs (MiB) | receive buffer rows |",
        "|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        lines.append(
            f"| {variant} | {Spread.of(r['seconds']).format()} | "
            f"{_ratios(r['seconds'], base['seconds']).format(1, 3)} | {_mib(r['temp_bytes'])} | "
            f"{_mib(r['argument_bytes'] + r['output_bytes'])} | {r['bound_rows'] or '-'} |"
        )
    return [*lines, ""]


def _socket_figures(measured: dict) -> dict[str, dict]:
    """Per variant: mean bytes per device and step sent to the other host (trimmed and
    whole) and the step seconds of each round."""
    devices = measured["devices_per_process"]
    return {
        variant: {
            "remote": float(np.mean(v["remote"])) / devices,
            "remote_whole": float(np.mean(v["remote_whole"])) / devices,
            "seconds": v["seconds"],
        }
        for variant, v in measured["variants"].items()
    }


def _socket_table(name: str, measured: dict, shaped: bool) -> list[str]:
    from experiments.shared.spread import Spread

    figures = _socket_figures(measured)
    base = figures[BASELINE]
    where = "shaped link" if shaped else "loopback"
    lines = [
        f"### `{name}`",
        "",
        "| variant | sent to the other host (MiB) | / capacity 1.25 | the same pieces whole "
        f"(MiB) | step on the {where} (ms), median [range] | / capacity 1.25, per round |",
        "|---|---|---|---|---|---|",
    ]
    for variant, f in figures.items():
        lines.append(
            f"| {variant} | {_mib(f['remote'])} | {f['remote'] / base['remote']:.3f} | "
            f"{_mib(f['remote_whole'])} | {Spread.of(f['seconds']).format()} | "
            f"{_ratios(f['seconds'], base['seconds']).format(1, 3)} |"
        )
    return [*lines, ""]


def _inside(spread) -> str:
    return "inside the spread" if spread.low <= 1.0 <= spread.high else "outside the spread"


def _preset_reading(name: str, results: dict, moe: dict) -> str:
    """What one preset's dispatch figures say, each statement read off them."""
    base, ragged = results[BASELINE], results["ragged dropless"]
    padded, bounded = results["padded dropless"], results["ragged dropless, 2x buffer"]
    ratio = ragged["routed_bytes"] / base["routed_bytes"]
    time_ragged = _ratios(ragged["seconds"], padded["seconds"])
    time_bounded = _ratios(bounded["seconds"], padded["seconds"])
    cpu_ragged = ragged["expert_flops_cpu"] / padded["expert_flops_cpu"]
    cpu_bounded = bounded["expert_flops_cpu"] / padded["expert_flops_cpu"]
    return (
        f"`{name}` ({moe['num_experts']} experts, top-{moe['top_k']}): ragged dropless "
        f"moves {ratio:.3f}x the bytes of capacity 1.25 where `ragged_all_to_all` runs "
        f"(target <= {BYTES_TARGET}: {met(ratio, BYTES_TARGET)}), padded dropless "
        f"{padded['routed_bytes'] / base['routed_bytes']:.2f}x (E/k = "
        f"{moe['num_experts'] / moe['top_k']:g}); nothing dropped "
        f"({ragged['dropped_fraction']:.4f}). On XLA:CPU the static form's all-to-all "
        f"operands are {ragged['a2a_bytes'] / padded['a2a_bytes']:.2f}x the padded ones, and "
        f"its grouped GEMM multiplies {cpu_ragged:.2f}x the padded rows (the worst-case "
        "buffer, masked per slot) where a grouped GEMM multiplies "
        f"{ragged['expert_flops_gemm'] / padded['expert_flops_gemm']:.3f}x; its step takes "
        f"{time_ragged.format(1, 3)}x the padded step ({_inside(time_ragged)}) and its "
        f"temporaries {ragged['temp_bytes'] / padded['temp_bytes']:.2f}x. With the 2x buffer: "
        f"{cpu_bounded:.2f}x the padded rows on CPU, step {time_bounded.format(1, 3)}x "
        f"({_inside(time_bounded)}), temporaries "
        f"{bounded['temp_bytes'] / padded['temp_bytes']:.2f}x, and "
        f"{bounded['dropped_fraction']:.4f} of the assignments dropped past the buffer."
    )


def _socket_reading(name: str, measured: dict) -> str:
    figures = _socket_figures(measured)
    ragged, padded = figures["ragged dropless"], figures["padded dropless"]
    ratio = ragged["remote"] / figures[BASELINE]["remote"]
    time_padded = _ratios(ragged["seconds"], padded["seconds"])
    time_base = _ratios(ragged["seconds"], figures[BASELINE]["seconds"])
    return (
        f"Sockets, `{name}`: ragged dropless sent {ratio:.3f}x the bytes of capacity 1.25 to "
        f"the other host (target <= {BYTES_TARGET}: {met(ratio, BYTES_TARGET)}), its pieces "
        f"{ragged['remote'] / ragged['remote_whole']:.3f}x their whole size; its step took "
        f"{time_padded.format(1, 3)}x the padded step ({_inside(time_padded)}) and "
        f"{time_base.format(1, 3)}x the capacity 1.25 step ({_inside(time_base)}), per round."
    )


def _dispatch_reading(result: dict) -> list[str]:
    lines = []
    for name in PRESETS:
        if name in result["dispatch"]:
            text = _preset_reading(name, result["dispatch"][name], result["presets"][name])
            lines += [text, ""]
    for name in PRESETS:
        if name in result.get("sockets", {}).get("measured", {}):
            lines += [_socket_reading(name, result["sockets"]["measured"][name]), ""]
    return lines


def write_report(result: dict, path: Path) -> str:
    path.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Dropless dispatch: capacity, padded and ragged; placement for dropless routing",
        "",
        *(f"Command ({part}): `{command}`" for part, command in result["commands"].items()),
        "",
        f"Machine: {result['host']}. Every figure is per device and per step unless it says "
        "otherwise. The presets as defined (no width or step count shrunk for the dispatch "
        "runs).",
        "",
    ]
    if "dispatch" in result:
        lines += [
            "## Bytes, FLOPs, time and memory on 8 fake CPU devices",
            "",
            "One process, layout 1 x 8 (data x expert), the byte corpus. *All-to-all "
            "operands*: what the step's all-to-alls carry here, read from the captured "
            "program (whole operands: for ragged, the pieces of the static form that XLA:CPU "
            "runs, since it cannot run `ragged_all_to_all`). *Moved by `ragged_all_to_all`*: "
            "every kept assignment's row once per exchange (dispatch and return, forward and "
            "backward), counted from each timed step's routing: what moves on GPU and TPU; "
            "capacity and padded buffers move whole on every backend, so there it is their "
            "operands. The ragged dispatch also all-gathers its counts first "
            f"({_kib_counts(result['dispatch'])} per step here, left out above). "
            "*Expert GFLOPs*: the routed experts' GEMMs forward and backward over the rows "
            "a grouped GEMM multiplies (GPU/TPU) and over what XLA:CPU multiplies "
            "(`ragged_dot` lowers there to a masked dense matmul per "
            "local slot: slots x receive buffer rows). *Compiled step GFLOPs*: XLA's cost "
            "analysis of the whole step. *Step*: "
            f"{result['repeats']} rounds of {result['steps']} steps per variant after "
            f"{WARMUP} untimed rounds, the variants interleaved (order reversed every other "
            "round) on the same batches; median and range of the round medians, and of each "
            "round's ratio (the machine was shared with other work: single timings spread "
            "widely, so compare the per-round ratios). *Temp*, *arguments + outputs*: "
            "`memory_analysis` of the compiled step. *Dropped*, *max/mean device load* (the "
            "routed assignments of the busiest device over the mean, per MoE layer): over "
            "the timed steps. Every variant starts "
            f"from the same state, trained {result['warm_steps']} steps by the padded "
            "dropless step first.",
            "",
        ]
        for name in PRESETS:
            if name in result["dispatch"]:
                lines += _dispatch_tables(name, result["dispatch"][name])
    if "sockets" in result:
        sockets = result["sockets"]
        calibration = sockets.get("calibration")
        where = (
            f"the emulated cluster: {SOCKET_HOSTS} hosts (network namespaces) x 4 devices, "
            f"joined by a {sockets['link_mbit']:g} Mbit/s link"
            if calibration
            else f"loopback: {SOCKET_HOSTS} processes x 4 devices"
        )
        lines += [
            "## Over the socket transport",
            "",
            f"On {where}; layout 1 x 8, so half of every exchange crosses to the other host. "
            "Schedule `none` over the socket transport; every variant's step in interleaved "
            f"rounds on the same batches ({sockets['rounds']} timed rounds after {WARMUP}), "
            f"from the same state trained {sockets['warm_steps']} steps first. "
            "*Sent to the other host*: the transport's own counter "
            "(`SocketTransport.traffic`), host 0's bytes over its 4 devices, per device and "
            "step: a ragged exchange's pieces are sent only up to their last routed row. "
            "*Whole*: what those pieces are untrimmed.",
            "",
        ]
        if calibration:
            lines += [
                f"Link calibrated: a {calibration['message_bytes'] / 2**20:.2f} MiB message at "
                f"{calibration['rate_fraction']:.1%} of the rate, {calibration['pieces']} "
                f"pieces {calibration['pieces_ratio']:.3f}x one message "
                f"({'passed' if calibration['passed'] else 'NOT passed'}).",
                "",
            ]
        for name in PRESETS:
            if name in sockets["measured"]:
                lines += _socket_table(name, sockets["measured"][name], bool(calibration))
    if "dispatch" in result:
        lines += ["## Reading", "", *_dispatch_reading(result)]
    if "placement" in result:
        lines += placement_lines(result)
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text
