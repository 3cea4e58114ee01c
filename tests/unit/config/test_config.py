"""Config loading (YAML + CLI overrides, names and types) and every validity rule's message."""

from __future__ import annotations

import pytest
import yaml

from xorl.config import Config, ConfigError, load_config, parse_overrides, validate_config
from xorl.distributed import ParallelConfig

# -- loading -------------------------------------------------------------------------------


def test_default_config_is_valid_for_one_process():
    config = Config()
    validate_config(config, world_size=1)
    assert ParallelConfig.from_config(config, 1).mesh_shape == (1, 1, 1, 1, 1, 1)
    assert config.model.vocab_size >= 256 + 16


def test_yaml_then_overrides_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"model_type": "qwen3_moe", "num_experts": 8, "mlp_only_layers": [1], "head_dim": 32},
                "data": {"seq_len": 64, "packing": False},
                "train": {"lr": 0.01, "tensor_parallel_size": 2, "adam_betas": [0.8, 0.99]},
            }
        )
    )
    overrides = [
        "--train.lr=3e-4",  # YAML 1.1 reads this as a string; a float field takes it
        "--train.max_steps",
        "7",  # two-token form
        "--data.seq_len=256",
        "--model.mlp_only_layers=[0,1]",
        "--model.head_dim=null",
        "--train.resume=true",
        "--train.output_dir=123",  # a str field keeps the text as written
        "--train.weight_decay=0",  # an int literal for a float field
    ]
    config = load_config(str(path), overrides)
    assert config.model.model_type == "qwen3_moe" and config.model.num_experts == 8
    assert config.model.mlp_only_layers == [0, 1] and config.model.head_dim is None
    assert config.data.seq_len == 256 and config.data.packing is False
    assert config.train.lr == 3e-4 and isinstance(config.train.lr, float)
    assert config.train.max_steps == 7 and config.train.tensor_parallel_size == 2
    assert config.train.adam_betas == (0.8, 0.99)
    assert config.train.resume is True and config.train.output_dir == "123"
    assert config.train.weight_decay == 0.0 and isinstance(config.train.weight_decay, float)
    # untouched fields keep their defaults
    assert config.model.hidden_size == Config().model.hidden_size

    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(config.to_yaml())
    again = load_config(str(dumped))
    assert again == config
    assert again.to_dict() == config.to_dict()
    assert config.to_dict()["train"]["adam_betas"] == [0.8, 0.99]  # plain lists for YAML / JSON


def test_later_override_wins_and_empty_yaml_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    config = load_config(str(path), ["--train.lr=0.5", "--train.lr=0.25"])
    assert config.train.lr == 0.25 and config.model == Config().model


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b=1", "c.d=x=y", "--e.f", "[1, 2]"]) == [
        ("a", "b", "1"),
        ("c", "d", "x=y"),
        ("e", "f", "[1, 2]"),
    ]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--train.lr", "no value"),
        ("--lr=1", "section.key"),
        ("--train.optim.lr=1", "section.key"),
    ],
)
def test_malformed_override_is_an_error(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--trian.lr=1", "unknown config section 'trian' (did you mean 'train'?)"),
        ("--train.warmup_step=5", "unknown key train.warmup_step (did you mean 'warmup_steps'?)"),
        ("--train.seq_len=64", "'seq_len' is in the 'data' section: use data.seq_len"),
        ("--model.hiden_size=8", "did you mean 'hidden_size'?"),
        ("--train.learning_rate=1", "unknown key train.learning_rate (did you mean 'lr'?)"),
        # bare words meaning a different field in each section
        ("--data.path=x.jsonl", "unknown key data.path (did you mean 'dataset'?)"),
        ("--model.path=folder", "unknown key model.path (did you mean 'model_path'?)"),
        ("--train.path=x", "unknown key train.path; `xorl-train --help`"),
    ],
)
def test_unknown_names_in_overrides_are_named(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)


def test_unknown_names_in_yaml_are_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layers: 4\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key model.num_layers"):
        load_config(str(path))
    path.write_text("modle:\n  hidden_size: 4\n")
    with pytest.raises(ConfigError, match=r"unknown config section 'modle' \(did you mean 'model'\?\)"):
        load_config(str(path))
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(path))
    path.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="section 'train' must be a mapping"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--train.tensor_parallel_size=two", "train.tensor_parallel_size: expected int, got 'two'"),
        ("--train.tensor_parallel_size=2.5", "train.tensor_parallel_size: expected int, got 2.5"),
        ("--train.max_steps=true", "train.max_steps: expected int, got True"),
        ("--train.max_steps=null", "train.max_steps: expected int, got None"),
        ("--data.packing=3", "data.packing: expected bool"),
        ("--train.lr=fast", "train.lr: expected float"),
        ("--model.head_dim=1.5", "model.head_dim: expected int or null"),
        ("--model.mlp_only_layers=[1,x]", "model.mlp_only_layers[1]: expected int"),
        ("--train.adam_betas=[0.9]", "train.adam_betas: expected a list of 2 values"),
        ("--train.dtype=bf16", "train.dtype='bf16' is not one of ['float32', 'bfloat16'] (did you mean 'bfloat16'?)"),
        ("--train.pipeline_parallel_schedule=1f1b", "did you mean '1F1B'?"),
        ("--model.router_scoring=sigmod", "did you mean 'sigmoid'?"),
    ],
)
def test_type_errors_name_the_field(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)


def test_yaml_type_error_names_file_and_field(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  dataset: 5\n")
    with pytest.raises(ConfigError, match="data.dataset: expected a string, got 5 .*quote it"):
        load_config(str(path))


# -- validity rules ------------------------------------------------------------------------

MOE = ["--model.model_type=qwen3_moe", "--model.num_experts=8", "--model.num_experts_per_tok=2"]


def _problems(overrides: list[str], world_size: int) -> str:
    config = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(config, world_size)
    return str(info.value)


# Each rule: (overrides, world_size, phrases the message must contain: the field(s) and the fix).
RULES = {
    "sizes multiply to world_size": (
        ["--train.tensor_parallel_size=2", "--train.data_parallel_shard_size=2"],
        8,
        ["multiply to world_size=8", "tensor_parallel_size=2", "= 4", "data_parallel_shard_size: -1"],
    ),
    "other sizes do not divide world_size": (
        ["--train.tensor_parallel_size=3"],
        8,
        ["does not divide 8", "tensor_parallel_size=3", "launch a multiple of 3 ranks"],
    ),
    "pp needs microbatches": (
        ["--train.pipeline_parallel_size=4", "--model.num_hidden_layers=4"],
        4,
        ["gradient_accumulation_steps=1", "pipeline_parallel_size=4", "set gradient_accumulation_steps >= 4"],
    ),
    "interleaved rounds": (
        ["--train.pipeline_parallel_size=4", "--train.gradient_accumulation_steps=9",
         "--train.pipeline_parallel_schedule=Interleaved1F1B", "--train.virtual_pipeline_stages=2",
         "--model.num_hidden_layers=8"],
        4,
        ["gradient_accumulation_steps=9", "rounds", "use a multiple of 4"],
    ),
    "experts divisible by ep": (
        ["--model.model_type=qwen3_moe", "--model.num_experts=6", "--train.expert_parallel_size=4"],
        4,
        ["num_experts=6", "multiple of train.expert_parallel_size=4"],
    ),
    "ep on a dense model": (
        ["--train.expert_parallel_size=2"],
        2,
        ["expert_parallel_size=2 on a dense model", "set expert_parallel_size: 1"],
    ),
    "ep folds over dp_shard x cp": (
        [*MOE, "--train.expert_parallel_size=4"],
        2,
        ["expert_parallel_size=4 must divide the ranks it folds over", "data_parallel_shard_size=2",
         "= 2", "use one of [1, 2]"],
    ),
    "heads divisible by ulysses": (
        ["--train.ulysses_parallel_size=8"],
        8,
        ["num_attention_heads=4", "ulysses_parallel_size=8", "choose ulysses_parallel_size dividing 4"],
    ),
    "heads divisible by ulysses x tp": (
        ["--train.ulysses_parallel_size=4", "--train.tensor_parallel_size=2"],
        8,
        ["num_attention_heads=4", "ulysses_parallel_size=4 x tensor_parallel_size=2"],
    ),
    "kv heads above ulysses must divide": (
        ["--model.num_attention_heads=12", "--model.num_key_value_heads=6", "--model.head_dim=16",
         "--train.ulysses_parallel_size=4"],
        4,
        ["num_key_value_heads=6", "not divisible by train.ulysses_parallel_size=4"],
    ),
    "kv heads below ulysses must replicate evenly": (
        ["--model.num_attention_heads=12", "--model.num_key_value_heads=3", "--model.head_dim=16",
         "--train.ulysses_parallel_size=4"],
        4,
        ["ulysses_parallel_size=4 must be a multiple of the 3 KV heads", "replicated evenly"],
    ),
    "heads divisible by tp": (
        ["--train.tensor_parallel_size=4"],
        4,
        ["num_attention_heads=4 and num_key_value_heads=2", "tensor_parallel_size=4", "dividing 2"],
    ),
    "sequence parallel requires tp": (
        ["--train.sequence_parallel=true"],
        1,
        ["sequence_parallel=true requires tensor_parallel_size > 1", "set sequence_parallel: false"],
    ),
    "sequence parallel splits the local sequence": (
        ["--train.sequence_parallel=true", "--train.tensor_parallel_size=2", "--data.seq_len=63"],
        2,
        ["data.seq_len=63", "sequence_parallel", "use seq_len 64"],
    ),
    "ring needs seq_len % 2 x ring": (
        ["--train.ringattn_parallel_size=2", "--data.seq_len=126"],
        2,
        ["data.seq_len=126", "2 x ringattn_parallel_size=2 = 4", "use seq_len 128", "never truncated"],
    ),
    "ring with packing still needs it": (
        ["--train.ringattn_parallel_size=4", "--data.seq_len=100", "--data.packing=true"],
        4,
        ["data.seq_len=100", "= 8", "use seq_len 104"],
    ),
    "ring x ulysses": (
        ["--train.ringattn_parallel_size=2", "--train.ulysses_parallel_size=2", "--data.seq_len=132"],
        4,
        ["2 x ringattn_parallel_size=2 x ulysses_parallel_size=2 = 8", "use seq_len 136"],
    ),
    "ulysses alone": (
        ["--train.ulysses_parallel_size=2", "--data.seq_len=127"],
        2,
        ["data.seq_len=127", "ulysses_parallel_size=2 = 2", "use seq_len 128"],
    ),
    "sizes >= 1": (
        ["--train.tensor_parallel_size=0", "--train.data_parallel_shard_size=-2"],
        1,
        ["tensor_parallel_size=0 must be an integer >= 1", "data_parallel_shard_size=-2", "or -1"],
    ),
    "interleaved needs virtual stages": (
        ["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
         "--train.pipeline_parallel_schedule=Interleaved1F1B"],
        2,
        ["virtual_pipeline_stages=1", "Interleaved1F1B", "set virtual_pipeline_stages >= 2"],
    ),
    "zbv needs exactly two stages": (
        ["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2", "--model.num_hidden_layers=6",
         "--train.pipeline_parallel_schedule=ZBVZeroBubble", "--train.virtual_pipeline_stages=3"],
        2,
        ["virtual_pipeline_stages=3", "exactly 2 stages", "set virtual_pipeline_stages: 2"],
    ),
    "1f1b runs one stage per rank": (
        ["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
         "--train.virtual_pipeline_stages=2"],
        2,
        ["virtual_pipeline_stages=2", "1F1B runs one stage per pipeline rank"],
    ),
    "layers >= stages": (
        ["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
         "--train.pipeline_parallel_schedule=Interleaved1F1B", "--train.virtual_pipeline_stages=2"],
        2,
        ["num_hidden_layers=2 is fewer than the 4 pipeline stages", "add layers or use fewer stages"],
    ),
    "data_parallel_mode none with dp > 1": (
        ["--train.data_parallel_mode=none"],
        2,
        ["data_parallel_mode='none' but the data-parallel size is 2", "use data_parallel_mode 'fsdp2' or 'ddp'"],
    ),
    "data_parallel_mode none with cp": (
        ["--train.data_parallel_mode=none", "--train.ringattn_parallel_size=2"],
        2,
        ["data_parallel_mode='none' cannot reduce gradients across the 2 context-parallel ranks"],
    ),
    "top-k <= num_experts": (
        [*MOE, "--model.num_experts_per_tok=9"],
        1,
        ["num_experts_per_tok=9", "between 1 and num_experts=8"],
    ),
    "llama is dense": (
        ["--model.num_experts=4"],
        1,
        ["num_experts=4 but model_type='llama' is dense", "set num_experts: 0"],
    ),
    "qwen3_moe needs experts": (
        ["--model.model_type=qwen3_moe"],
        1,
        ["qwen3_moe' needs num_experts >= 1"],
    ),
    "mlp_only_layers in range": (
        [*MOE, "--model.mlp_only_layers=[0,5]"],
        1,
        ["mlp_only_layers has [5]", "0..1"],
    ),
    "gqa": (
        ["--model.num_key_value_heads=3"],
        1,
        ["num_attention_heads=4 must be a multiple of num_key_value_heads=3"],
    ),
    "hidden divisible by heads": (
        ["--model.num_attention_heads=6", "--model.num_key_value_heads=6"],
        1,
        ["hidden_size=64 is not divisible by num_attention_heads=6", "set model.head_dim"],
    ),
    "models' own checks (odd head_dim)": (
        ["--model.head_dim=15"],
        1,
        ["model:", "head_dim=15 must be even"],
    ),
    "byte tokenizer needs 256 ids": (
        ["--model.vocab_size=100"],
        1,
        ["vocab_size=100 is too small for data.tokenizer='byte'", "which has 259 tokens", "vocab_size >= 259"],
    ),
    "dataset path exists": (
        ["--data.dataset=/no/such/file.jsonl"],
        1,
        ["data.dataset='/no/such/file.jsonl': no such file", "'builtin'"],
    ),
    "ddp cannot reduce tensor-parallel shards": (
        ["--train.data_parallel_mode=ddp", "--train.tensor_parallel_size=2"],
        2,
        ["data_parallel_mode='ddp' with tensor_parallel_size=2", "use data_parallel_mode: fsdp2"],
    ),
    "ddp cannot reduce expert-parallel shards": (
        [*MOE, "--train.data_parallel_mode=ddp", "--train.expert_parallel_size=2"],
        2,
        ["data_parallel_mode='ddp' with expert_parallel_size=2", "use data_parallel_mode: fsdp2"],
    ),
    "export_hf with a sigmoid router": (
        [*MOE, "--model.router_scoring=sigmoid", "--train.export_hf=true"],
        1,
        ["export_hf=true with model.router_scoring='sigmoid'", "set export_hf: false"],
    ),
    "export_hf with a shared expert": (
        [*MOE, "--model.shared_expert_intermediate_size=32", "--train.export_hf=true"],
        1,
        ["shared_expert_intermediate_size=32", "no shared expert", "set export_hf: false"],
    ),
    "numbers must be finite": (
        ["--train.lr=.inf", "--train.weight_decay=.nan", "--train.adam_eps=.inf"],
        1,
        ["train.lr=inf must be a finite number", "train.weight_decay=nan must be a finite number",
         "train.adam_eps=inf must be a finite number"],
    ),
    "seq_len within max_position_embeddings": (
        ["--data.seq_len=4096", "--model.max_position_embeddings=2048"],
        1,
        ["data.seq_len=4096 is longer than model.max_position_embeddings=2048", "use seq_len <= 2048"],
    ),
    "seq_len >= 2": (
        ["--data.seq_len=1"],
        1,
        ["data.seq_len=1 must be >= 2"],
    ),
    "collective timeout > 0": (
        ["--train.collective_timeout_s=0", "--train.heartbeat_s=-1"],
        1,
        ["collective_timeout_s=0.0 must be > 0", "heartbeat_s=-1.0 must be >= 0"],
    ),
    "pipeline_grad_sync without pipeline parallelism": (
        ["--train.pipeline_grad_sync=per_step"],
        2,
        ["train.pipeline_grad_sync: per_step applies to pipeline stages", "set pipeline_parallel_size > 1"],
    ),
    "pipeline_grad_sync without fsdp2": (
        ["--train.pipeline_grad_sync=per_microbatch", "--train.data_parallel_mode=ddp",
         "--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2"],
        4,
        ["train.pipeline_grad_sync: per_microbatch applies to data_parallel_mode: fsdp2", "or use fsdp2"],
    ),
    "pipeline_grad_sync per_microbatch under zero-bubble": (
        ["--train.pipeline_grad_sync=per_microbatch", "--train.pipeline_parallel_size=2",
         "--train.gradient_accumulation_steps=2", "--train.pipeline_parallel_schedule=ZBVZeroBubble",
         "--train.virtual_pipeline_stages=2", "--model.num_hidden_layers=4"],
        4,
        ["pipeline_grad_sync: per_microbatch with pipeline_parallel_schedule: ZBVZeroBubble",
         "use pipeline_grad_sync: per_step (or default)"],
    ),
    "optimizer ranges": (
        ["--train.lr=0", "--train.min_lr_ratio=2", "--train.adam_betas=[0.9,1.0]"],
        1,
        ["train.lr=0.0 must be > 0", "min_lr_ratio=2.0 must be in [0, 1]", "adam_betas=[0.9, 1.0]"],
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_rule_message_names_field_and_fix(rule):
    overrides, world_size, phrases = RULES[rule]
    message = _problems(overrides, world_size)
    for phrase in phrases:
        assert phrase in message, f"{rule}: {phrase!r} not in:\n{message}"


@pytest.mark.parametrize(
    "overrides, world_size",
    [
        # the boundary cases each rule must still allow
        (["--train.pipeline_parallel_size=4", "--train.gradient_accumulation_steps=4",
          "--model.num_hidden_layers=4"], 4),
        (["--train.pipeline_parallel_size=4", "--train.gradient_accumulation_steps=10",
          "--train.pipeline_parallel_schedule=Interleaved1F1B", "--train.virtual_pipeline_stages=2",
          "--model.num_hidden_layers=8"], 8),
        (["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
          "--train.pipeline_parallel_schedule=ZBVZeroBubble", "--train.virtual_pipeline_stages=2",
          "--model.num_hidden_layers=4"], 2),
        # KV heads (2) fewer than ulysses (4): replicated
        (["--train.ulysses_parallel_size=4", "--data.seq_len=128"], 4),
        (["--train.tensor_parallel_size=2", "--train.ulysses_parallel_size=2", "--train.sequence_parallel=true"], 8),
        (["--train.ringattn_parallel_size=4", "--train.ulysses_parallel_size=2", "--data.seq_len=128"], 8),
        ([*MOE, "--train.expert_parallel_size=8", "--train.ringattn_parallel_size=2",
          "--train.ulysses_parallel_size=2"], 16),
        ([*MOE, "--train.expert_parallel_size=4", "--train.pipeline_parallel_size=2",
          "--train.gradient_accumulation_steps=2", "--train.ulysses_parallel_size=4"], 8),
        (["--train.data_parallel_mode=none", "--train.tensor_parallel_size=2"], 2),
        (["--train.data_parallel_replicate_size=2", "--train.data_parallel_shard_size=4"], 8),
        # tied embeddings: a copy on the first and the last stage, kept in step (parallel/pipeline_parallel.py)
        (["--train.pipeline_parallel_size=4", "--train.gradient_accumulation_steps=4",
          "--model.num_hidden_layers=4", "--model.tie_word_embeddings=true"], 4),
        (["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
          "--train.pipeline_parallel_schedule=ZBVZeroBubble", "--train.virtual_pipeline_stages=2",
          "--model.num_hidden_layers=4", "--model.tie_word_embeddings=true"], 2),
        # pipeline_grad_sync: per_step on the 1F1B family, and on zero-bubble (what it does anyway)
        (["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
          "--train.pipeline_grad_sync=per_step", "--train.fsdp_reshard_after_forward=never"], 4),
        (["--train.pipeline_parallel_size=2", "--train.gradient_accumulation_steps=2",
          "--train.pipeline_parallel_schedule=ZBVZeroBubble", "--train.virtual_pipeline_stages=2",
          "--model.num_hidden_layers=4", "--train.pipeline_grad_sync=per_step"], 2),
        # schedule fields do not apply without PP
        (["--train.pipeline_parallel_schedule=Interleaved1F1B"], 1),
    ],
)
def test_valid_layouts_pass(overrides, world_size):
    validate_config(load_config(None, overrides), world_size)


def test_every_type_error_is_reported_not_just_the_first(tmp_path):
    path = tmp_path / "typos.yaml"
    path.write_text("model:\n  hidden_size: big\n  num_layers: 2\ntrain:\n  lr: fast\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["--train.max_steps=x", "--data.seq_len", "--trian.lr=1"])
    message = str(info.value)
    assert message.startswith("invalid config (6 problems)"), message
    for phrase in (f"{path}: model.hidden_size: expected int, got 'big'", "unknown key model.num_layers",
                   f"{path}: train.lr: expected float, got 'fast'", "train.max_steps: expected int, got 'x'",
                   "'--data.seq_len' has no value", "unknown config section 'trian'"):
        assert message.count(phrase) == 1, (phrase, message)


def test_files_the_run_needs_are_checked_up_front(tmp_path):
    (tmp_path / "data.bin").write_text("text\nhello\n")  # (.csv is read through Hugging Face datasets)
    (tmp_path / "not_a_folder").write_text("")
    (tmp_path / "empty_dir").mkdir()
    message = _problems([f"--data.dataset={tmp_path / 'data.bin'}",
                         f"--train.output_dir={tmp_path / 'not_a_folder'}"], 1)
    assert "data.bin': unknown file type; xorl reads .jsonl/.txt/.parquet" in message
    assert "not_a_folder' is a file, not a folder" in message
    message = _problems([f"--data.dataset={tmp_path / 'empty_dir'}",
                         f"--train.output_dir={tmp_path / 'not_a_folder' / 'run'}"], 1)
    assert "the folder holds no .jsonl/.txt/.parquet files" in message
    assert "cannot be created" in message


def test_all_problems_are_reported_together():
    message = _problems(["--train.tensor_parallel_size=4", "--train.lr=-1", "--train.expert_parallel_size=2"], 4)
    assert message.startswith("invalid config (3 problems)")
    for phrase in ("tensor_parallel_size=4", "train.lr=-1.0", "dense model"):
        assert phrase in message


def test_parallel_config_from_config_and_resolved_sizes():
    config = load_config(None, ["--train.pipeline_parallel_size=2", "--train.data_parallel_replicate_size=2",
                                "--train.ringattn_parallel_size=2", "--train.ulysses_parallel_size=2",
                                "--train.tensor_parallel_size=2", "--train.expert_parallel_size=4",
                                "--train.gradient_accumulation_steps=2"])
    parallel = ParallelConfig.from_config(config, world_size=64).validate()
    assert parallel.mesh_shape == (2, 2, 2, 2, 2, 2)
    assert (parallel.cp, parallel.dp, parallel.dp_shard_cp, parallel.dp_cp, parallel.ep_fsdp) == (4, 4, 8, 16, 4)
    assert parallel.data_parallel_shard_size == -1  # the user's value is kept; dp_shard is resolved


def test_parallel_config_validates_on_its_own():
    with pytest.raises(ConfigError, match=r"pipeline_parallel_schedule='Zbv' is not one of"):
        ParallelConfig(pipeline_parallel_schedule="Zbv", world_size=1).validate()
    with pytest.raises(ConfigError, match="world_size is not set"):
        ParallelConfig().validate()
    with pytest.raises(ConfigError, match="does not divide 6"):
        ParallelConfig(tensor_parallel_size=4, world_size=6).dp_shard  # noqa: B018
