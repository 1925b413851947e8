"""The rows a two-corpus mixture trains on, counted against its weights.

    python -m experiments.data_mixture [--steps 1000] [--weights 3:1 0.7:0.3 1:2]

Two corpora are cut from the default corpus (the standard library's sources): its first
half as byte ids 0..255, its second half as ids 256..511, each a ``.bin`` of its own, so
that every row tells which corpus it came from. For each pair of weights, the ``tiny``
preset's batches (32 rows of 65 tokens on 8 fake CPU devices) are read for ``--steps``
steps through the training input pipeline itself (:class:`jaxmoe.data.host_batches
.HostBatches`: Grain's mixture, this process's rows, its prefetch threads, each global
batch laid out on the mesh as the train step receives it), and the rows of each corpus
counted: over the run, and per step. The validation batches of one evaluation are
counted too. Writes ``experiments/results/data_mixture.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from experiments.shared.results_file import command_line

RESULTS = Path(__file__).parent / "results" / "data_mixture.md"
# The first corpus's ids; the second's are these plus OFFSET.
OFFSET = 256


def _pair(text: str) -> tuple[float, float]:
    first, _, second = text.partition(":")
    return float(first), float(second)


def grain_shares(weights: tuple[float, ...]) -> list[int]:
    """The integers ``grain.MapDataset.mix`` realises ``weights`` as: the smallest scaled
    to 100, each truncated (tests/data/test_mixture.py checks it on Grain's output)."""
    scale = 100 / min(weights)
    return [int(weight * scale) for weight in weights]


def _corpora(directory: Path, max_bytes: int) -> tuple[Path, Path]:
    """The default corpus's two halves (of its first ``max_bytes``) as ``.bin`` files of
    ids 0..255 and 256..511."""
    import numpy as np

    from jaxmoe.data.batches import load_tokens

    tokens = load_tokens(None, max_bytes).astype("<u2")
    half = len(tokens) // 2
    low, high = directory / "low.bin", directory / "high.bin"
    tokens[:half].tofile(low)
    (tokens[half:] + np.uint16(OFFSET)).tofile(high)
    return low, high


def measure(weights: tuple[float, float], corpora: tuple[Path, Path], steps: int) -> dict:
    """The rows of each corpus over ``steps`` training batches and one evaluation's
    validation batches, with ``weights``."""
    import jax
    import numpy as np

    from jaxmoe.cli.parser import config_from_train_args
    from jaxmoe.data.host_batches import DataPosition, HostBatches
    from jaxmoe.data.mixture import load_mixture, run_batches
    from jaxmoe.parallel.mesh import build_mesh

    sources = [f"{path}:{weight:g}" for path, weight in zip(corpora, weights, strict=True)]
    config = config_from_train_args(
        ["--preset", "tiny", "--model.vocab_size", str(2 * OFFSET), "--data", *sources]
    )
    mixture = load_mixture(config)
    train, val = run_batches(config, mixture)
    mesh = build_mesh(config.parallel)
    second_per_step = []
    started = time.perf_counter()
    with HostBatches(train, mesh, DataPosition(), config.data.prefetch) as batches:
        for _ in range(steps):
            rows = jax.device_get(batches.next_on_mesh())
            second_per_step.append(int((rows.min(axis=1) >= OFFSET).sum()))
    seconds = time.perf_counter() - started
    val_rows = np.concatenate([val.rows(index) for index in range(config.train.eval_batches)])
    return {
        "weights": weights,
        "shares": grain_shares(weights),
        "batch": config.train.batch_size,
        "second": second_per_step,
        "val_rows": len(val_rows),
        "val_second": int((val_rows.min(axis=1) >= OFFSET).sum()),
        "seconds": seconds,
    }


def _row(result: dict, steps: int) -> str:
    first_weight, second_weight = result["weights"]
    stated = second_weight / (first_weight + second_weight)
    shares = result["shares"]
    realised = shares[1] / sum(shares)
    rows = steps * result["batch"]
    second = sum(result["second"])
    measured = second / rows
    per_step = result["second"]
    val = result["val_second"] / result["val_rows"]
    return (
        f"| {first_weight:g} : {second_weight:g} | {shares[0]} : {shares[1]} | {rows} "
        f"| {rows - second} | {second} | {measured:.4%} | {stated:.4%} | {realised:.4%} "
        f"| {measured - stated:+.4%} | {min(per_step)}-{max(per_step)} "
        f"| {result['val_second']} of {result['val_rows']} ({val:.2%}) "
        f"| {result['seconds'] / steps * 1e3:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--weights", nargs="+", type=_pair, default=None, metavar="A:B")
    parser.add_argument("--max-bytes", type=int, default=8_000_000, help="of the default corpus")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    pairs = args.weights or [(3.0, 1.0), (0.7, 0.3), (1.0, 2.0)]

    from jaxmoe.parallel.host_devices import ensure_host_devices

    ensure_host_devices(8)

    import grain
    import jax

    with tempfile.TemporaryDirectory() as scratch:
        corpora = _corpora(Path(scratch), args.max_bytes)
        results = [measure(pair, corpora, args.steps) for pair in pairs]

    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, {jax.device_count()} "
        f"{jax.devices()[0].platform} devices, jax {jax.__version__}, grain "
        f"{grain.__version__}, Python {platform.python_version()}"
    )
    command = command_line("experiments.data_mixture", sys.argv[1:] if argv is None else argv)
    report = "\n".join(
        [
            "# Data mixtures: the rows of each corpus against the weights",
            "",
            f"Command: `{command}`",
            "",
            f"Machine: {machine}.",
            "",
            "Two corpora cut from the default corpus (the standard library's sources, "
            f"{args.max_bytes / 1e6:g} MB): "
            f"its first half as ids 0..{OFFSET - 1}, its second as ids {OFFSET}.."
            f"{2 * OFFSET - 1}, so that each row names its corpus. The `tiny` preset's "
            f"batches ({results[0]['batch']} rows of 65 tokens, 8 devices), read for "
            f"{args.steps} steps through the training input pipeline (`HostBatches`: Grain's "
            "mixture, this process's rows, 2 prefetch threads, each batch laid out on the "
            "mesh), then one evaluation's validation batches.",
            "",
            "| weights | Grain's shares | rows | first corpus | second corpus | second, "
            "measured | second, stated | second, Grain's shares | measured - stated | "
            "second per step (min-max) | validation rows of the second | ms per batch "
            "(read, laid out, fetched back) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *(_row(result, args.steps) for result in results),
            "",
            "Grain realises the weights as integers, the smallest scaled to 100 "
            "(`MapDataset.mix`), and interleaves them deterministically: of every "
            "sum-of-shares consecutive rows each corpus gives exactly its share. The measured "
            "fraction is Grain's shares' fraction over any whole number of periods; it "
            "differs from the stated weights only where they are not ratios of integers "
            "with the smallest 100 (0.7 : 0.3 is 233 : 100, 30.03% where 30% was stated). "
            "Every step holds the same count of each corpus within one row.",
            "",
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
