"""The research options as the experiments take them: flags beside jaxmoe train's, the
link told to the profile, the rest handed to the step as scheduling.ExperimentalOptions."""

import json

import pytest

import scheduling
from experiments.emulation import socket_transport
from experiments.emulation.experimental import (
    Experimental,
    experimental_config,
    link_profile,
    saved_config,
)
from jaxmoe.config import Config, ConfigError


def test_the_flags_are_taken_off_the_train_flags_and_given_back():
    argv = ["--schedule", "dw", "--experimental.transport", "socket", "--moe.top_k", "2"]
    argv += ["--experimental.link_mbit", "50", "--experimental.partition_always", "true"]
    rest, options = Experimental.split(argv)
    assert rest == ["--schedule", "dw", "--moe.top_k", "2"]
    assert options == Experimental(transport="socket", link_mbit=50.0, partition_always=True)
    assert Experimental.split(options.argv()) == ([], options)
    assert Experimental().argv() == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--experimental.sockets", "true"], "--experimental.sockets: unknown"),
        (["--experimental.transport", "pigeon"], "transport='pigeon': choose one of xla"),
        (["--experimental.link_mbit"], "give it a value"),
        (["--experimental.xla_groups", "maybe"], "true or false"),
    ],
)
def test_a_bad_flag_is_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        Experimental.split(argv)


def test_the_link_is_told_to_the_profile_as_a_profile_file():
    config, options = experimental_config(
        ["--schedule.profile", "cpu", "--experimental.link_mbit", "50"]
    )
    assert options.options() is None  # the link alone is the configuration's
    profile = config.schedule.device_profile
    assert profile.link_bytes_per_s == 50e6 / 8
    cpu = scheduling.PROFILES["cpu"]
    assert (profile.flops_per_s, profile.link_latency_s) == (cpu.flops_per_s, cpu.link_latency_s)
    assert config.schedule.profile == link_profile("cpu", 50.0)  # written once, the same
    assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_the_step_gets_the_other_options():
    options = Experimental(transport="socket", exchange="rounds:8", xla_groups=True).options()
    assert isinstance(options, scheduling.ExperimentalOptions)
    assert (options.exchange, options.xla_groups, options.partition_always) == (
        "rounds:8",
        True,
        False,
    )
    assert options.transport is not None
    assert socket_transport.over_sockets(partition_always=True).partition_always


def test_a_saved_configuration_of_before_gives_its_research_options_back():
    values = Config().to_dict()
    values["schedule"].update(
        name="lancet", profile="cpu", transport="socket", link_mbit=50.0, partition_always=False
    )
    values["schedule"]["exchange"] = None
    config, options = saved_config(values)
    assert options == Experimental(transport="socket", link_mbit=50.0)
    assert config.schedule.transport == "xla"
    assert config.schedule.device_profile.link_bytes_per_s == 50e6 / 8
    # A configuration saved since: the options come from the flags recorded beside it.
    config, options = saved_config(Config().to_dict(), ["--experimental.transport", "socket"])
    assert options.transport == "socket" and config == Config()
