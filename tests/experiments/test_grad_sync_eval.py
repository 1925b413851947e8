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
