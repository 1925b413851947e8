"""Configuration files: TOML and a run's config.json read into the configuration, every
name checked with the closest one offered, written back as TOML; the presets are such
files, shipped with the package."""

import json
import tomllib
from pathlib import Path

import pytest

import scheduling
from jaxmoe.config import (
    Config,
    ConfigError,
    DataConfig,
    DataSource,
    MoEConfig,
    ScheduleConfig,
    TrainConfig,
)
from jaxmoe.config.config import config_sections
from jaxmoe.config.files import read_config_file, to_toml
from jaxmoe.presets import PRESETS, preset, preset_file

ROOT = Path(__file__).resolve().parents[2]


def test_a_toml_file_reads_none_integers_and_a_profile_of_its_own(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        """
        [moe]
        capacity_factor = "none"   # dropless, as --moe.capacity_factor none
        top_k = 2
        [train]
        learning_rate = 1          # an integer where the field is a float
        grad_clip_norm = "None"
        [schedule]
        name = "lancet"
        [schedule.profile]
        name = "mine"
        flops_per_s = 1e12
        memory_bytes_per_s = 1e11
        op_overhead_s = 0.0
        link_bytes_per_s = 1e9
        link_latency_s = 1e-5
        """
    )
    config = Config.from_dict(read_config_file(path))
    assert config.moe == MoEConfig(capacity_factor=None, top_k=2)
    assert config.train == TrainConfig(learning_rate=1.0, grad_clip_norm=None)
    assert isinstance(config.train.learning_rate, float)
    assert config.schedule.profile == scheduling.DeviceProfile("mine", 1e12, 1e11, 0.0, 1e9, 1e-5)


def test_a_saved_config_json_reads_back_as_the_configuration(tmp_path):
    config = Config(
        moe=MoEConfig(capacity_factor=None, top_k=2),
        data=DataConfig(sources=(DataSource('corpus "quoted"\n.txt'),)),
        schedule=ScheduleConfig(name="lancet", profile=scheduling.PROFILES["cpu"]),
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict(), indent=2))  # as a run writes it
    assert Config.from_dict(read_config_file(path)) == config


def test_a_mixture_is_a_list_of_tables_and_a_saved_data_path_one_source(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text('[data]\nsources = [{ path = "web.bin", weight = 3 }, { path = "c.bin" }]\n')
    config = Config.from_dict(read_config_file(path))
    assert config.data.sources == (DataSource("web.bin", 3.0), DataSource("c.bin", 1.0))
    path.write_text(to_toml(config_sections(config.to_dict())))
    assert 'sources = [{ path = "web.bin", weight = 3.0 }, { path = "c.bin"' in path.read_text()
    assert Config.from_dict(read_config_file(path)) == config
    # A run saved before mixtures: data.path, read as one source of weight 1.
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps({"data": {"path": "web.bin", "val_fraction": 0.1}}))
    assert Config.from_dict(read_config_file(saved)).data == DataConfig(
        sources=(DataSource("web.bin"),), val_fraction=0.1
    )
    saved.write_text(json.dumps({"data": {"path": None}}))
    assert Config.from_dict(read_config_file(saved)).data == DataConfig()
    for text, message in [
        ('sources = [{ path = "a.bin", wieght = 3 }]', "unknown field data.sources[0].wieght: "),
        ('sources = ["a.bin"]', "data.sources[0]='a.bin': a source is a table, { path = "),
        ("sources = [{ weight = 3 }]", "data.sources[0] has no path: give the corpus's file"),
        ('path = "a.bin"\nsources = []', "data.path and data.sources are both given"),
    ]:
        path.write_text(f"[data]\n{text}\n")
        with pytest.raises(ConfigError) as error:
            read_config_file(path)
        assert str(error.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize("name", ["tiny", "deepseek_v3-671b"])
def test_every_field_written_as_toml_reads_back(name, tmp_path):
    config = preset(name)
    text = to_toml(config_sections(config.to_dict()), header="a header\nof two lines")
    assert text.startswith("# a header\n# of two lines\n\n[model]\n")
    path = tmp_path / "every.toml"
    path.write_text(text)
    assert Config.from_dict(read_config_file(path)) == config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[modle]\nd_model = 64", "unknown section 'modle': did you mean model?"),
        ("[model]\nd_mode = 64", "unknown field model.d_mode: did you mean model.d_model?"),
        ("[train]\nnum_experts = 4", "unknown field train.num_experts: did you mean moe.num_"),
        ("[parallel]\npipe = 2", "unknown field parallel.pipe: did you mean parallel.pipeline?"),
        ("[schedule]\nnmae = 'dw'", "unknown field schedule.nmae: did you mean schedule.name?"),
        ("steps = 5", "unknown section 'steps': did you mean train.steps?"),
        ("[model]\nwidht = 64", "unknown field model.widht: model has activation, attention,"),
        ("model = 5", "model=5: model is a section, a table of its fields ([model] in a"),
        ("[model\nd_model = 64", "not valid TOML (Expected ']' at the end of a table declar"),
        ("[schedule]\nop_cost_cache = '/c'", "schedule.op_cost_cache='/c': the run fills it in"),
        ("[train]\nschedule = 'dw'", "train.schedule is now schedule.name: write it there"),
    ],
)
def test_a_bad_name_is_refused_in_one_line_naming_the_file_and_the_closest_name(
    text, message, tmp_path
):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        read_config_file(path)
    assert str(error.value).startswith(f"{path}: {message}")
    assert "\n" not in str(error.value)


def test_a_file_that_is_not_a_configuration_file_is_refused(tmp_path):
    for name, message in [
        ("absent.toml", "no such file or directory: give a configuration file (TOML), or"),
        ("run.yaml", "a configuration file is TOML (.toml), or a run's config.json"),
        ("list.json", "expected a table of sections, not list"),
    ]:
        path = tmp_path / name
        if name != "absent.toml":
            path.write_text("[1, 2]")
        with pytest.raises(ConfigError) as error:
            read_config_file(path)
        assert str(error.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_is_its_file_over_the_defaults(name):
    values = tomllib.loads(preset_file(name).read_text())
    assert preset(name) == Config.from_dict(values)
    assert preset(name).model.moe_layers


def test_the_preset_files_are_package_data():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["jaxmoe.presets"]
    shipped = {
        path.stem for pattern in patterns for path in (ROOT / "jaxmoe/presets").glob(pattern)
    }
    assert shipped == set(PRESETS) and "tiny" in shipped
