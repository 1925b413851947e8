"""The GPU check's dry run: every section's code path on a CPU device at tiny shapes, and
the files it writes (the figures themselves need the GPU)."""

import dataclasses
import json
import os
import time

import pytest

from experiments import gpu_check


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    assert gpu_check.main(["--dry", "--out", str(out)]) == 0
    text = (out / "gpu_check.json").read_text()
    return out, text, json.loads(text)


def test_the_files_say_in_their_first_line_that_the_run_was_dry(dry_run):
    out, text, results = dry_run
    assert text.splitlines()[0] == '{"dry": true,'
    markdown = (out / "gpu_check.md").read_text()
    assert markdown.splitlines()[0] == "# GPU check: DRY RUN on CPU, tiny shapes, no GPU figures"
    assert results["platform"] == "cpu" and results["jax"]
    assert results["command"].startswith("python -m experiments.gpu_check --dry --out ")
    assert list(results["sections"]) == list(gpu_check.SECTIONS)
    for name, section in results["sections"].items():
        assert "error" not in section, name
        assert f"## {name}" in markdown


def test_attention_compares_every_core_that_runs_with_the_float32_reference(dry_run):
    attention = dry_run[2]["sections"]["attention"]
    assert attention["auto"] == "blockwise"
    assert attention["cudnn_refusal"].startswith("it runs on NVIDIA GPUs")
    for variant in ("causal", "packed"):
        entry = attention["variants"][variant]
        assert "cudnn" in entry["skipped"]
        assert entry["ratio_to"] == "blockwise_16"  # no cuDNN: the first core that ran
        assert list(entry["cores"]) == ["blockwise_16", "dense"]
        for result in entry["cores"].values():
            assert set(result["max_abs_diff"]) == {"out", "dq", "dk", "dv"}
            assert max(result["max_abs_diff"].values()) < 1e-4  # float32 throughout
            assert len(result["seconds"]["values"]) == 1 and result["ratio"]["median"] > 0
    assert attention["variants"]["packed"]["documents"] == 5
    # Under "matmuls" the blockwise core's forward loop runs once: its residuals are kept.
    assert attention["forwards_under_matmuls"] == {"blockwise": 0}


def test_gemm_times_bf16_and_fp8_side_by_side(dry_run):
    gemm = dry_run[2]["sections"]["gemm"]
    assert gemm["peak_bf16_tflops"] is None  # a CPU: no datasheet peak, no fraction of it
    assert [(e["m"], e["k"], e["n"]) for e in gemm["shapes"]] == list(gpu_check.DRY.gemms)
    for entry in gemm["shapes"]:
        assert entry["bf16_tflops"]["median"] > 0 and entry["fp8_tflops"]["median"] > 0
        assert entry["fp8_over_bf16"]["median"] > 0 and "bf16_of_peak" not in entry
        assert entry["fp8_gemm"] is False  # XLA:CPU has no FP8 GEMM
        assert 0 < entry["fp8_max_rel_error"] < 0.2


def test_the_step_is_measured_and_estimated_per_step_and_per_block(dry_run):
    step = dry_run[2]["sections"]["step"]
    assert step["batch"] == 2 and step["memory_fit"]["fits"]
    assert step["model"]["layers"] == 2 and step["model"]["attention_core"] == "blockwise"
    estimate = step["estimate"]
    assert len(estimate["blocks_s"]) == 2 and 0 < estimate["block_s"] < estimate["step_s"]
    assert set(estimate["phases_s"]) >= {"forward", "backward"}
    assert len(step["measured"]["step_s"]["values"]) == gpu_check.DRY.steps
    assert "mfu" not in step  # no peak for a CPU
    profile = step["measured"]["profile"]  # each block's ops timed in a profiler trace
    assert profile["steps"] >= 1 and len(profile["blocks_s"]) == 2
    assert 0 < sum(profile["blocks_s"]) < profile["ops_s"]  # the head, loss and update too
    comparison = step["comparison"]
    assert comparison["block_measured_is"].startswith("profiled: the device time of the ops")
    assert comparison["block_measured_s"] == profile["block_s"]
    assert comparison["step_estimate_over_measured"] > 0
    # The compiled step's memory beside the walk's estimate; XLA:CPU keeps no allocator
    # statistics.
    memory = step["measured"]["compiled_memory"]
    assert memory["temp"] > 0 and memory["argument"] > 0
    assert (
        memory["peak"] == memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    )
    assert step["measured"]["device_memory"] is None
    assert "- memory: XLA's compiled step" in (dry_run[0] / "gpu_check.md").read_text()


def test_the_schedule_check_is_skipped_with_its_reason(dry_run):
    schedule = dry_run[2]["sections"]["schedule"]
    assert "refuses CPU devices" in schedule["skipped"]
    assert schedule["command"].startswith("python -m experiments.gpu_schedule_check --mock")


def test_a_failing_or_overrunning_section_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    def failing(setup, budget, found):
        raise RuntimeError("no such kernel")

    def overrunning(setup, budget, found):
        found["partial"] = True
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pass

    limits = {**gpu_check.DRY.limits, "step": 0.3}
    monkeypatch.setattr(gpu_check, "DRY", dataclasses.replace(gpu_check.DRY, limits=limits))
    functions = {**gpu_check.SECTION_FUNCTIONS, "gemm": failing, "step": overrunning}
    monkeypatch.setattr(gpu_check, "SECTION_FUNCTIONS", functions)
    args = ["--dry", "--out", str(tmp_path), "--sections", "gemm,step,schedule"]
    assert gpu_check.main(args) == 0
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["gemm"]["error"] == "RuntimeError: no such kernel"
    assert sections["step"]["partial"] and "ran past its limit" in sections["step"]["error"]
    assert sections["step"]["seconds"] < 5
    assert "skipped" in sections["schedule"]
    assert "Error: `RuntimeError: no such kernel`" in (tmp_path / "gpu_check.md").read_text()


def test_a_run_of_some_sections_keeps_the_others_with_the_run_they_came_from(tmp_path, monkeypatch):
    def measuring(value):
        def measure(setup, budget, found):
            found["value"] = value

        return measure

    def run(sections, value):
        functions = {
            **gpu_check.SECTION_FUNCTIONS,
            "gemm": measuring(value),
            "fp8": measuring(value),
        }
        monkeypatch.setattr(gpu_check, "SECTION_FUNCTIONS", functions)
        assert gpu_check.main(["--dry", "--out", str(tmp_path), "--sections", sections]) == 0
        return json.loads((tmp_path / "gpu_check.json").read_text())

    reporters = {**gpu_check.REPORTERS, "gemm": lambda found: [], "fp8": lambda found: []}
    monkeypatch.setattr(gpu_check, "REPORTERS", reporters)
    first = run("fp8,gemm", 1)["sections"]
    assert [first[name]["value"] for name in first] == [1, 1]
    results = run("fp8", 2)
    assert list(results["sections"]) == ["gemm", "fp8"]  # in the check's order
    gemm, fp8 = results["sections"]["gemm"], results["sections"]["fp8"]
    assert (gemm["value"], fp8["value"]) == (1, 2)
    assert gemm["run"]["command"].endswith("--sections fp8,gemm")
    assert fp8["run"]["command"] == results["command"] and fp8["run"]["date"] == results["date"]
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown.count("From an earlier run: `") == 1
    assert f"From an earlier run: `{gemm['run']['command']}`, jax " in markdown

    other_device = {**results, "device_kind": "another device"}
    (tmp_path / "gpu_check.json").write_text(json.dumps(other_device))
    assert list(run("fp8", 3)["sections"]) == ["fp8"]


def test_without_dry_it_refuses_a_host_with_no_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "--xla_gpu_enable_triton_gemm=false" in os.environ["XLA_FLAGS"]  # as with model.fp8
    assert capsys.readouterr().out.strip() == (
        "gpu_check needs a GPU, and found cpu: --dry tries it on CPU"
    )
    assert not (tmp_path / "gpu_check.json").exists()
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry", "--sections", "attention,fp16"])


def test_the_schedule_check_runs_in_a_process_of_its_own_and_its_table_is_kept(
    tmp_path, monkeypatch
):
    import subprocess

    import jax

    row = dict(seconds=[0.002, 0.003], compile_s=7.5, groups=12, kept=11, all_to_alls=32)
    written = {"none": {**row, "overlapped": 30}, "pair": {"error": "XlaRuntimeError: boom"}}
    commands = []

    def run(command, **options):
        commands.append((command, options))
        out = tmp_path / "gpu_schedule_check.json"
        out.write_text(json.dumps(written))
        return subprocess.CompletedProcess(command, 0, "stdout", "")

    monkeypatch.setattr(gpu_check.schedule.subprocess, "run", run)
    setup = gpu_check.Setup(False, gpu_check.GPU, tmp_path, jax.devices()[0])
    found = gpu_check.schedule.measure(setup, gpu_check.Budget(time.monotonic() + 60), {})
    ((command, options),) = commands
    assert command[1:3] == ["-m", "experiments.gpu_schedule_check"]
    assert command[-2:] == ["--out", str(tmp_path / "gpu_schedule_check.md")]
    assert options["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert 50 < options["timeout"] < 60
    assert found["returncode"] == 0 and found["results"] == written
    table = gpu_check.schedule.report(found)
    assert "| none | 11 of 12 | 30 of 32 | 7.5 | 2.5 [2.0-3.0] |" in table
    assert "| pair | XlaRuntimeError: boom ||||" in table

    def late(command, **options):
        raise subprocess.TimeoutExpired(command, options["timeout"], b"half", None)

    monkeypatch.setattr(gpu_check.schedule.subprocess, "run", late)  # the last run's file stays
    found = gpu_check.schedule.measure(setup, gpu_check.Budget(time.monotonic() + 60), {})
    assert found["error"].startswith("gpu_schedule_check ran past 5")
    assert found["output_tail"] == "half" and "results" not in found


def test_where_the_memory_walk_fails_the_step_takes_its_set_batch(monkeypatch):
    import jax

    import jaxmoe.plan.memory
    from jaxmoe.parallel.mesh import build_mesh

    def failing(program, state):
        raise NotImplementedError("no walk for this primitive")

    monkeypatch.setattr(jaxmoe.plan.memory, "step_memory", failing)
    sizes = gpu_check.DRY
    mesh = build_mesh(gpu_check.step.step_config(sizes, 1).parallel, [jax.devices()[0]])
    batch, fit, _ = gpu_check.step.fit_batch(mesh, sizes)
    assert batch == sizes.step_batch_unwalked
    assert fit["error"] == "NotImplementedError: no walk for this primitive"
    assert gpu_check.step.fit_text(fit).endswith("for this primitive`): a set batch")


def test_the_step_takes_the_largest_batch_the_walk_fits_walking_each_candidate(monkeypatch):
    from types import SimpleNamespace

    import jaxmoe.plan.memory

    # The peak stays the optimizer update's at first, then grows with the rows.
    walk = {1: 5e9, 2: 5e9, 4: 8e9, 8: 12e9, 16: 20e9}

    def capture(config, mesh):
        return SimpleNamespace(state_shapes=None), config.train.batch_size, None

    monkeypatch.setattr(gpu_check.step, "_capture", capture)
    monkeypatch.setattr(
        jaxmoe.plan.memory, "step_memory", lambda rows, shapes: SimpleNamespace(total=walk[rows])
    )
    sizes = dataclasses.replace(
        gpu_check.DRY, step_batches=(16, 1, 8, 2, 4), step_memory_bytes=10e9
    )
    batch, fit, captured = gpu_check.step.fit_batch(None, sizes)
    assert batch == 4 and fit["fits"] and fit["estimated_bytes"] == 8e9
    assert list(fit["walked_bytes"]) == [1, 2, 4, 8]  # none walked past the first over
    assert sorted(captured) == [1, 2, 4]


def test_fp8_times_one_expert_block_under_each_recipe(dry_run):
    found = dry_run[2]["sections"]["fp8"]
    assert (found["experts"], found["tokens"]) == gpu_check.DRY.expert_block[:2]
    assert list(found["recipes"]) == list(gpu_check.fp8.FP8_RECIPES)
    for recipe, entry in found["recipes"].items():
        assert entry["seconds"]["median"] > 0 and entry["tflops"]["median"] > 0
        assert entry["fp8_gemm"] is False  # XLA:CPU widens the float8 operands
        assert ("over_bf16" in entry) == (recipe != "none")
