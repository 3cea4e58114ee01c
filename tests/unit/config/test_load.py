"""Loading a config (xorl/config/load.py): duplicate YAML keys named by file and line, unknown keys
answered with the xorl name or close matches."""

from __future__ import annotations

import pytest

from xorl.config import ConfigError, load_config


def test_duplicate_yaml_keys_are_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 0.1\n  max_steps: 2\n  lr: 0.2\nmodel:\n  hidden_size: 32\nmodel:\n  seed: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert f"{path}:4: key 'train.lr' is set twice (also at line 2)" in message
    assert f"{path}:7: key 'model' is set twice (also at line 5)" in message
    path.write_text("train:\n  lr: 0.1\n  adam_betas: [0.9, 0.99]\ndata:\n  seq_len: 64\n")
    config = load_config(str(path))
    assert (config.train.lr, config.train.adam_betas, config.data.seq_len) == (0.1, (0.9, 0.99), 64)


@pytest.mark.parametrize("override, expected", [
    ("--train.learning_rate=1e-3", "unknown key train.learning_rate (did you mean 'lr'?)"),
    ("--train.per_device_train_batch_size=4", "(did you mean data.micro_batch_size?)"),
    ("--data.max_seq_length=512", "unknown key data.max_seq_length (did you mean 'seq_len'?)"),
    ("--train.warmup_step=5", "(did you mean 'warmup_steps'?); `xorl-train --help` lists every key"),
    ("--train.zzz=1", "unknown key train.zzz; `xorl-train --help` lists every key with its default"),
])
def test_unknown_keys_get_the_xorl_name_or_close_matches_not_every_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert expected in str(info.value)
    assert "the keys of" not in str(info.value) and "collective_timeout_s" not in str(info.value)
