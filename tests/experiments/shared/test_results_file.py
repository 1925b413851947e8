"""Sections kept from a results file's previous run."""

from experiments.shared.results_file import command_line, kept_section


def test_skipped_sections_are_kept_from_the_file_they_overwrite(tmp_path):
    path = tmp_path / "lancet_eval.md"
    path.write_text(
        "# T\n\nCommand: `make it`\n\n## (a) Emulated cluster\n\nA rows\n\n"
        "## (b) Simulator\n\nB rows\n"
    )
    kept_a = kept_section(path, "## (a)", "## (b)", "--skip-cluster")
    assert kept_a[0] == "## (a) Emulated cluster"
    assert "A rows" in kept_a and "B rows" not in kept_a
    kept_b = kept_section(path, "## (b)", None, "--skip-simulator")
    assert kept_b[-2] == "B rows" and "`--skip-simulator`" in kept_b[2]
    assert "made by `make it`" in kept_b[2]
    assert kept_section(tmp_path / "missing.md", "## (a)", None, "x") == []
    # Kept again by a run of another command: one note, naming the command that made it.
    path.write_text("# T\n\nCommand: `skip it`\n\n" + "\n".join(kept_b))
    again = kept_section(path, "## (b)", None, "--skip-simulator")
    assert again == kept_b
    assert kept_section(path, "## (b)", "## (z)", "x") == []  # no end after the heading


def test_the_command_line_is_quoted_for_a_shell():
    line = command_line("experiments.comet_eval", ["--step-models", "gpt2-moe-12 (12 x 768)"])
    assert line == "python -m experiments.comet_eval --step-models 'gpt2-moe-12 (12 x 768)'"


def test_a_kept_section_with_its_own_command_is_not_given_the_files(tmp_path):
    path = tmp_path / "cross_microbatch_eval.md"
    path.write_text(
        "# T\n\nCommand: `simulate it`\n\n## (a) Emulated cluster\n\nCommand: `measure it`\n\n"
        "A rows\n\n## (b) Simulator\n\nB rows\n"
    )
    kept_a = kept_section(path, "## (a)", "## (b)", "simulate")
    assert kept_a[2] == "Kept from an earlier run (`simulate` does not rerun it)."
    assert "Command: `measure it`" in kept_a and "simulate it" not in "\n".join(kept_a)
