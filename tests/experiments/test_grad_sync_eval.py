"""The gradient-sync evaluation's tables (its runner is tested in
emulation/test_grad_sync_runs.py; full runs are measurements, in experiments/results/)."""

from experiments.grad_sync_report import format_markdown, summarise, target_loss


def fake_result() -> dict:
    def run(algorithm, link, losses, step):
        return {
            "algorithm": algorithm,
            "link_mbit": link,
            "repeat": 0,
            "step_s": [step] * len(losses),
            "loss": losses,
            "link_bytes": 2_000_000 * len(losses),
        }

    falling = [5.0, 4.0, 3.0, 2.0, 1.0, 1.0]
    slower = [5.0, 4.5, 4.0, 3.5, 3.0, 2.5]
    runs = [
        run("allreduce", 50.0, falling, 2.0),
        run("int8", 50.0, falling, 1.0),
        run("decentralized", 50.0, slower, 0.5),
    ]
    return {
        "command": "python -m experiments.grad_sync_eval",
        "machine": "test",
        "hosts": 2,
        "devices_per_host": 4,
        "link_calibration": {},
        "config": {"parallel": {"data": 2, "expert": 4}, "train": {"batch_size": 64}},
        "steps": 6,
        "warmup": 1,
        "target_fraction": 0.5,
        "smoothing": 1,
        "runs": runs,
        "auto": {"50": {"chosen": "int8", "reason": "test", "estimates": []}},
    }


def test_tables_mark_the_winner_and_the_target():
    result = fake_result()
    assert target_loss(result) == 3.0  # allreduce's loss after half of the 6 steps
    table = summarise(result)["50"]
    # Reached after 3 steps of 2 s and of 1 s; decentralized after 5 of 0.5 s.
    assert table["allreduce"]["time_to_target_s"] == 6.0
    assert table["int8"]["time_to_target_s"] == 3.0
    assert table["decentralized"]["time_to_target_s"] == 2.5  # 5 steps of 0.5 s
    assert table["allreduce"]["mb_per_step"] == 1.0  # 2 MB per step over 2 hosts
    text = format_markdown(result, summarise(result))
    assert "| decentralized **winner** |" in text
    assert "| int8 (auto) |" in text
    assert "decentralized, reaches the target loss in 2.5 s against allreduce's 6.0 s: 2.40x" in (
        text
    )


def test_every_collective_the_syncs_add_to_the_curves_runs_on_the_mesh():
    """The kinds ``jaxmoe link-curves`` leaves out, as the curves pass times them: each runs
    on the cluster's mesh (data 2 x expert 4) and covers its kind and group size."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from experiments.grad_sync_eval import SYNC_COLLECTIVES, sync_collective
    from jaxmoe.config import ParallelConfig
    from jaxmoe.parallel.mesh import build_mesh

    mesh = build_mesh(ParallelConfig(data=2, expert=4))
    covered = set()
    for kind, axes in SYNC_COLLECTIVES:
        group = 1
        for axis in axes:
            group *= mesh.shape[axis]
        run = jax.jit(
            jax.shard_map(
                sync_collective(kind, axes, group),
                mesh=mesh,
                in_specs=PartitionSpec(),
                out_specs=PartitionSpec(),
                check_vma=False,
            )
        )
        assert float(run(jnp.ones((64,), jnp.float32))) > 0
        covered.add((kind, group))
    # The in-host reduce-scatter and all-gather of hierarchical, int8 and the decentralized
    # ones, the cross-host ppermutes and int8's all-gather.
    assert covered == {
        ("ppermute", 2),
        ("ppermute", 8),
        ("all_gather", 2),
        ("reduce_scatter", 4),
        ("all_gather", 4),
    }


def test_saved_curves_go_with_choices_only(capsys):
    from experiments.grad_sync_eval import main

    assert main(["--saved-curves"]) == 2
    assert "--saved-curves goes with --choices-only" in capsys.readouterr().err


def test_choices_remade_from_the_saved_curves_need_no_cluster(tmp_path):
    """--choices-only --saved-curves: auto's choice at a measured link remade from that
    link's curves file as saved, the runs kept, a note saying how."""
    import json
    import shutil

    from experiments.grad_sync_eval import RESULTS, main

    out = tmp_path / "grad_sync_eval.md"
    shutil.copy(RESULTS / "grad_sync_eval.json", out.with_suffix(".json"))
    before = json.loads(out.with_suffix(".json").read_text())
    argv = ["--links", "300", "--repeats", "2", "--steps", str(before["steps"])]
    # Extra flags go to the runs' configuration: auto's choice traced at one layer.
    argv += ["--model.num_layers", "1", "--model.moe_every", "1"]
    assert main([*argv, "--choices-only", "--saved-curves", "--out", str(out)]) == 0
    after = json.loads(out.with_suffix(".json").read_text())
    assert after["runs"] == before["runs"]
    choice = after["auto"]["300"]
    assert "grad_sync_eval_curves_300mbit.json" in choice["link"]
    assert {e["name"] for e in choice["estimates"]} == {
        e["name"] for e in before["auto"]["300"]["estimates"]
    }
    assert (
        "remade from the saved curves by `.venv/bin/python -m experiments.grad_sync_eval"
        in (after["note"])
    )
    assert "## 300 Mbit/s" in out.read_text()


def test_auto_is_judged_against_the_spread_of_the_winners_time():
    """An algorithm whose time to the target overlaps the winner's over the repeats is not
    told apart from it: auto choosing it differs from the winner, within the spread."""
    from experiments.grad_sync_report import auto_verdict, within_spread

    rows = {
        "int8": {"time_spread_s": (9.0, 10.0)},
        "decentralized-int8": {"time_spread_s": (9.5, 11.0)},
        "allreduce": {"time_spread_s": (18.0, 19.0)},
        "delayed": {"time_spread_s": None},
    }
    assert within_spread(rows, "int8") == ["decentralized-int8"]
    assert auto_verdict(rows, "int8", "int8") == (
        "agrees with the measurement (decentralized-int8 within the spread of the winner's time)"
    )
    assert auto_verdict(rows, "int8", "decentralized-int8") == (
        "differs from the measured winner, but decentralized-int8 is within the spread of its time"
    )
    assert auto_verdict(rows, "int8", "allreduce") == "differs from the measurement"
