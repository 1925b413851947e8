"""The README's configuration reference is what the config dataclasses' comments say."""

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from jaxmoe.config import reference
from scheduling import names

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_readme_configuration_reference_is_up_to_date():
    problem = reference.stale(README.read_text(encoding="utf-8"))
    assert problem is None, problem


def test_every_configuration_field_has_a_comment():
    for section, cls in reference.sections().items():
        undocumented = [name for name, text in reference.field_comments(cls).items() if not text]
        assert undocumented == [], f"{section}: write a comment above {undocumented}"


def test_every_choice_list_names_a_configuration_field():
    flags = {
        f"{section}.{name}"
        for section, cls in reference.sections().items()
        for name in cls.__dataclass_fields__
    }
    assert sorted(set(reference.CHOICES) - flags) == [], "remove them from reference.CHOICES"


def test_every_schedule_has_a_row_in_the_readme_schedules_table():
    text = README.read_text(encoding="utf-8")
    section = text.split("\n### Schedules\n", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)
    assert rows == list(names.POLICIES), "README's schedules table: one row per policy, in order"


@dataclass(frozen=True)
class _Toy:
    """A section with each way of documenting a field."""

    # Above the field,
    # over two lines.
    above: int = 1
    after: str | None = None  # at the end of its line
    # Both: above,
    both: bool = False  # and after.
    pragma: float = 0.5  # fmt: skip

    undocumented: int = 0


def test_a_field_comment_is_the_lines_above_it_then_the_one_after_it():
    assert reference.field_comments(_Toy) == {
        "above": "Above the field, over two lines.",
        "after": "at the end of its line",
        "both": "Both: above, and after.",
        "pragma": "",
        "undocumented": "",
    }
    with pytest.raises(reference.ReferenceTableError, match=r"toy\.pragma, toy\.undocumented"):
        reference.section_table("toy", _Toy)


def test_write_replaces_the_block_and_check_then_passes(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{reference.BEGIN}\nold\n{reference.END}\n\nafter\n")
    assert reference.main(["--check", str(readme)]) == 1
    assert reference.COMMAND in capsys.readouterr().err
    assert reference.main(["--write", str(readme)]) == 0
    assert reference.main(["--check", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\n") and text.endswith("\n\nafter\n")
    assert "| `--schedule.name` |" in text


def test_the_reference_is_built_without_importing_jax():
    code = (
        "import sys; from jaxmoe.config.reference import reference; reference(); "
        "print('jax' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "False"
