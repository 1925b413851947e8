"""Every invalid configuration is refused with one message naming the field and the fix."""

import dataclasses
import json
import re

import pytest

from jaxmoe.config import (
    Config,
    ConfigError,
    DataConfig,
    DataSource,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
    capacity_per_expert,
)
from jaxmoe.config.schedule import schedule_section
from jaxmoe.presets import preset

# A valid multi-head latent attention, as the cases below change it.
MLA = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, position="rope")


def section(**fields):
    """The schedule section as a configuration reads it."""
    return schedule_section(fields)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelConfig(d_model=100, num_heads=3), "model.d_model=100 is not divisible"),
        (lambda: ModelConfig(num_layers=0), "model.num_layers=0: must be a positive integer"),
        (lambda: ModelConfig(num_layers=2, moe_every=3), "model.moe_every=3 and model.first"),
        (lambda: ModelConfig(num_layers=2, first_dense_layers=2), "leave no MoE layer"),
        (lambda: ModelConfig(num_heads=4, num_kv_heads=3), "model.num_kv_heads=3 does not"),
        (lambda: ModelConfig(position="rope", head_dim=7), "needs an even width"),
        # Multi-head latent attention: its widths, and what it does not combine with.
        (lambda: ModelConfig(kv_lora_rank=8), "model.qk_nope_head_dim is unset"),
        (lambda: ModelConfig(q_lora_rank=8), "model.q_lora_rank=8: a field of multi-head"),
        (lambda: ModelConfig(**dict(MLA, position="learned")), "model.position='learned' with"),
        (lambda: ModelConfig(**MLA, num_kv_heads=2), "model.num_kv_heads=2 with multi-head"),
        (lambda: ModelConfig(**dict(MLA, qk_rope_head_dim=3)), "model.qk_rope_head_dim=3: "),
        (lambda: ModelConfig(**dict(MLA, kv_lora_rank=0)), "model.kv_lora_rank=0: must be"),
        (lambda: ModelConfig(rope_mscale=-1.0), "model.rope_mscale=-1.0: must be >= 0"),
        (lambda: ModelConfig(norm="batchnorm"), "model.norm='batchnorm'"),
        (lambda: ModelConfig(rope_scaling_factor=0.5), "model.rope_scaling_factor=0.5"),
        (lambda: MoEConfig(shared_expert_gate=True), "set moe.num_shared_experts"),
        (lambda: ModelConfig(dtype="float16"), "model.dtype='float16'"),
        (
            lambda: ModelConfig(fp8="e5m2"),
            "model.fp8='e5m2': must be one of none, tensorwise, blockwise",
        ),
        (
            lambda: ModelConfig(recompute="full"),
            "model.recompute='full': must be one of none, attention",
        ),
        (lambda: MoEConfig(dispatcher="ring"), "moe.dispatcher='ring': must be one of all_to_all"),
        (lambda: MoEConfig(num_experts=4, top_k=5), "moe.top_k=5 is larger than moe.num_experts"),
        (lambda: MoEConfig(capacity_factor=0.0), "moe.capacity_factor=0.0: must be > 0"),
        (lambda: MoEConfig(capacity_factor=-1.0), "moe.capacity_factor=-1.0: must be > 0"),
        (lambda: MoEConfig(score_function="relu"), "moe.score_function='relu'"),
        (lambda: MoEConfig(group_size=0), "moe.group_size=0: must be a positive integer"),
        (lambda: MoEConfig(jitter=1.5), "moe.jitter=1.5: must be in [0, 1)"),
        (lambda: MoEConfig(aux_loss_coef=-1.0), "moe.aux_loss_coef=-1.0"),
        (lambda: ParallelConfig(data=0), "parallel.data=0: must be a positive integer"),
        (lambda: TrainConfig(batch_size=0), "train.batch_size=0"),
        (lambda: TrainConfig(learning_rate=0.0), "train.learning_rate=0.0: must be > 0"),
        (lambda: TrainConfig(grad_clip_norm=0.0), "train.grad_clip_norm=0.0"),
        (lambda: section(name="fast"), "schedule.name='fast': choose one of none"),
        (lambda: section(op_costs="guessed"), "schedule.op_costs='guessed'"),
        (lambda: section(async_min_bytes=-1), "schedule.async_min_bytes=-1"),
        (lambda: section(partition_chunks=9), "schedule.partition_chunks=9"),
        (lambda: section(partition_chunks=1), "or none to let the search choose"),
        (lambda: section(name="expert_pipeline"), "needs its pipelining degree"),
        (lambda: section(transport="carrier pigeon"), "schedule.transport="),
        (lambda: section(profile="tpu"), "schedule.profile='tpu': choose one of a100"),
        (lambda: section(max_live_bytes_growth=float("inf")), "expected a finite float"),
        (lambda: section(op_cost_cache="/cache"), "the run fills it in, not a setting"),
        (lambda: section(widht=3), "unknown field schedule.widht: schedule has "),
        # Research options: no settings, each refused with where it went.
        (lambda: section(link_mbit=-5.0), "schedule.link_mbit=-5.0: the cost model's link"),
        (lambda: section(link_mbit=50.0), "is its profile's: choose --schedule.profile, or"),
        (lambda: section(partition_always=True), "ExperimentalOptions(partition_always=True)"),
        (lambda: section(exchange="rounds:8"), "ExperimentalOptions(exchange=...)"),
        (lambda: section(transport="socket"), "experiments/emulation/socket_transport.py"),
        (lambda: section(xla_pin="groups"), "ExperimentalOptions(xla_groups=True)"),
        (lambda: DataConfig(val_fraction=1.0), "data.val_fraction=1.0"),
        (lambda: DataConfig(prefetch=-1), "data.prefetch=-1: must be an integer >= 0"),
        (lambda: DataSource("a.bin", 0.0), "'a.bin' has weight 0.0: a weight is a finite"),
        (lambda: DataSource("a.bin", float("nan")), "'a.bin' has weight nan"),
        (lambda: DataSource(""), "data.sources: path='': give the corpus's file"),
        (
            lambda: DataConfig(sources=(DataSource("a.bin", 2.0), DataSource("./a.bin"))),
            "data.sources: './a.bin' is given twice (as 'a.bin' too): give each corpus once",
        ),
        (
            lambda: Config(schedule=section(name="pair")),
            "schedule.name=pair runs each microbatch's passes beside another's, but "
            "train.microbatches=1 gives it one: set train.microbatches to 2 or more",
        ),
        (
            lambda: Config(schedule=section(name="comet", pair_microbatches=True)),
            "schedule.pair_microbatches=true (with schedule.name=comet) runs each microbatch's",
        ),
        (
            lambda: Config(moe=MoEConfig(num_experts=6), parallel=ParallelConfig(expert=4)),
            "moe.num_experts=6 is not divisible by parallel.expert=4",
        ),
        (
            lambda: Config(
                parallel=ParallelConfig(data=2, expert=4), train=TrainConfig(batch_size=12)
            ),
            "train.batch_size=12 is not divisible by the 8 batch shards",
        ),
        (
            lambda: Config(
                model=ModelConfig(seq_len=64), moe=MoEConfig(group_size=48), train=TrainConfig()
            ),
            "moe.group_size=48 does not divide the 256 tokens per device",
        ),
        (lambda: Config(model=ModelConfig(vocab_size=100)), "model.vocab_size=100"),
        (
            lambda: Config(moe=MoEConfig(slots_per_device=2, dispatcher="all_gather")),
            "moe.slots_per_device=2 (replicas) needs moe.dispatcher=all_to_all, parallel.expert_te",
        ),
        (
            lambda: Config(
                moe=MoEConfig(slots_per_device=3),
                parallel=ParallelConfig(data=1, expert=4, expert_tensor=2),
            ),
            "moe.slots_per_device=3 (replicas) needs moe.dispatcher=all_to_all, parallel.expert_te",
        ),
        (
            lambda: Config(
                moe=MoEConfig(capacity_factor=None, dropless_dispatch="ragged"),
                parallel=ParallelConfig(data=1, expert=4, expert_tensor=2),
            ),
            "parallel.expert_tensor=2 splits each expert's hidden dimension: set parallel.exp",
        ),
        (
            lambda: ParallelConfig(data=1, expert=8, context=2, context_exchange="p2p"),
            "parallel.context_exchange='p2p'",
        ),
        (
            lambda: ParallelConfig(data=1, expert=8, context=3),
            "parallel.tensor=1 x parallel.context=3 does not divide the 8 devices",
        ),
        (
            lambda: ParallelConfig(data=2, expert=3, context=2),
            "tensor x context (= 2), expert_tensor and expert_tensor x expert (= 3) must divide",
        ),
        (
            lambda: Config(
                model=ModelConfig(seq_len=12), parallel=ParallelConfig(data=1, expert=8, context=4)
            ),
            "model.seq_len=12 is not divisible by 2 x parallel.context=8 (two chunks a device",
        ),
        (
            lambda: Config(
                model=ModelConfig(seq_len=20),
                parallel=ParallelConfig(data=1, expert=8, context=2, tensor=4),
            ),
            "model.seq_len / parallel.context=10 is not divisible by parallel.tensor=4",
        ),
        (
            lambda: Config(
                model=ModelConfig(sliding_window=8), parallel=ParallelConfig(expert=8, context=2)
            ),
            "parallel.context=2 with model.sliding_window=8: context parallelism runs full",
        ),
        (
            lambda: Config(
                model=ModelConfig(seq_len=64),
                moe=MoEConfig(group_size=32),
                parallel=ParallelConfig(expert=8, context=2),
            ),
            "a routing group must divide the runs of 16 consecutive positions a device holds",
        ),
    ],
)
def test_invalid_values_are_refused_with_the_field_named(build, message):
    with pytest.raises(ConfigError) as error:
        build()
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().d_model = 3


def test_round_trip_through_a_dict():
    config = Config(moe=MoEConfig(capacity_factor=None, top_k=2))
    assert Config.from_dict(config.to_dict()) == config


def test_the_schedule_section_is_the_policy_and_round_trips_a_profile_of_its_own():
    import scheduling

    assert Config().schedule == scheduling.SchedulePolicy(name="none")
    own = scheduling.PROFILES["cpu"].with_link(1e6)
    config = Config(schedule=ScheduleConfig(name="lancet", profile=own))
    assert Config.from_dict(config.to_dict()) == config


def test_a_saved_schedule_section_of_before_keeps_its_settings_without_the_research_options():
    values = Config().to_dict()
    values["schedule"].update(partition_always=False, exchange=None, link_mbit=0.0)
    assert Config.from_dict(values) == Config()
    values["schedule"]["link_mbit"] = 50.0
    with pytest.raises(ConfigError, match=r"^schedule\.link_mbit=50\.0: the cost model's link"):
        Config.from_dict(values)


def test_a_saved_moe_section_of_before_loads_without_the_replica_split_at_its_default():
    """Runs saved while the split was a setting resume at ``balanced``, the library's; one
    saved at another split is refused in one line naming the field and the fix."""
    values = Config(moe=MoEConfig(capacity_factor=None, dropless_dispatch="ragged")).to_dict()
    assert "replica_split" not in values["moe"]
    values["moe"]["replica_split"] = "balanced"
    assert Config.from_dict(values) == Config(
        moe=MoEConfig(capacity_factor=None, dropless_dispatch="ragged")
    )
    values["moe"]["replica_split"] = "round_robin"
    with pytest.raises(ConfigError) as error:
        Config.from_dict(values)
    message = str(error.value)
    assert message.startswith("moe.replica_split='round_robin': experimental, no longer a setting")
    assert "remove it" in message and "ExperimentalOptions(replica_split=...)" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("old", "message"),
    [
        ("schedule_profile", "train.schedule_profile is now schedule.profile: write it there"),
        ("schedule", "train.schedule is now schedule.name: write it there (--schedule.name)"),
        ("schedule_socket_all_to_all", "train.schedule_socket_all_to_all: experimental"),
    ],
)
def test_an_old_train_schedule_field_is_refused_naming_the_new_one(old, message):
    values = Config().to_dict()
    values["train"][old] = "cpu"
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config.from_dict(values)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule.partition_always", "true"], "--schedule.partition_always: experimental"),
        (["--schedule.exchange", "rounds:8"], "--schedule.exchange: experimental"),
        (["--schedule.link_mbit", "50"], "--schedule.link_mbit: the cost model's link is its"),
        (["--schedule.transport", "socket"], "schedule.transport='socket': experimental"),
        (["--schedule.xla_pin", "groups"], "schedule.xla_pin='groups': experimental"),
        (["--schedule.op_cost_cache", "x"], "--schedule.op_cost_cache: the run fills it in"),
        (["--train.schedule_profile", "cpu"], "--train.schedule_profile is now --schedule.pro"),
        (["--train.schedule_link_mbit", "5"], "--train.schedule_link_mbit: the cost model's"),
        (["--moe.replica_split", "round_robin"], "--moe.replica_split: experimental, no long"),
        (["--moe.replica_split", "balanced"], "--moe.replica_split: experimental, no longer"),
    ],
)
def test_flags_of_the_research_options_and_old_fields_are_refused_in_one_line(argv, message):
    from jaxmoe.cli.parser import config_from_train_args

    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        config_from_train_args(argv)
    assert "\n" not in str(error.value)


def test_a_profile_file_is_named_in_the_configuration_and_read_by_the_input_checks(tmp_path):
    from jaxmoe.cli.inputs import check_link_curves
    from jaxmoe.cli.parser import config_from_train_args

    missing = config_from_train_args(["--schedule.profile", str(tmp_path / "mine.json")])
    with pytest.raises(ConfigError, match="cannot read this profile file"):
        check_link_curves(missing.schedule)
    import scheduling

    (tmp_path / "mine.json").write_text(
        json.dumps(dataclasses.asdict(scheduling.PROFILES["cpu"].with_link(1e6)))
    )
    check_link_curves(missing.schedule)
    assert missing.schedule.device_profile.link_bytes_per_s == 1e6


def test_unknown_preset_names_the_choices():
    with pytest.raises(
        ConfigError, match=r"unknown preset 'huge': choose one of deepseek_v3-671b, .*gpt2-moe-12, "
    ):
        preset("huge")


def test_capacity_and_moe_layers():
    assert capacity_per_expert(64, 1, 1.25, 8) == 10
    assert capacity_per_expert(64, 2, 1.0, 8) == 16
    assert capacity_per_expert(64, 2, None, 8) == 64
    assert ModelConfig(num_layers=6, moe_every=2).moe_layers == (1, 3, 5)
    assert Config().group_size == Config().model.seq_len


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TrainConfig(adam_b1="0.9"), "train.adam_b1='0.9': expected a finite float"),
        (lambda: TrainConfig(learning_rate=float("inf")), "train.learning_rate=inf"),
        (lambda: TrainConfig(grad_clip_norm="1"), "train.grad_clip_norm='1'"),
        (lambda: ModelConfig(d_model=64.0), "model.d_model=64.0: expected a finite int"),
        (lambda: MoEConfig(normalize_top_k=1), "moe.normalize_top_k=1: expected a finite bool"),
        (
            lambda: Config.from_dict({"model": {"widht": 3}}),
            "unknown field model.widht: model has activation, attention, attention_bias, attention",
        ),
    ],
)
def test_values_of_the_wrong_type_are_refused_with_the_field_named(build, message):
    with pytest.raises(ConfigError) as error:
        build()
    assert message in str(error.value)
