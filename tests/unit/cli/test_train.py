"""`xorl-train`'s entry (xorl/cli/train.py): --help lists every key with its default and meaning, and
importing it sets the CUDA allocator's expandable segments unless the user chose a setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.support.cli_runs import ROOT
from xorl.config import Config, DataConfig, TrainConfig, config_help, field_docs


def test_help_lists_every_key_with_its_default_and_meaning(capsys):
    from xorl.cli.train import main

    for flag in ("--help", "-h"):
        main([flag])  # returns: exit code 0
        out = capsys.readouterr().out
        assert out.startswith("usage: xorl-train") and "\ntrain:\n" in out and "\n  seq_len: 128  (int)" in out
    text = config_help()
    for section, cls in (("data", DataConfig), ("train", TrainConfig)):
        docs = field_docs(cls)
        for name, value in yaml.safe_load(Config().to_yaml())[section].items():
            # every data and train key documented, its default shown as JSON
            assert docs.get(name), f"{section}.{name} has no comment in xorl/config/sections.py"
            line = next(ln for ln in text.splitlines() if ln.startswith(f"  {name}: "))
            assert json.loads(line.split("  (")[0].split(": ", 1)[1]) == value
    assert "  lr: 0.001  (float) peak learning rate" in text


@pytest.mark.slow
def test_xorl_train_turns_on_expandable_segments_unless_the_user_set_the_allocator():
    # Before torch is imported (the allocator reads its setting once), and never over a user's own.
    probe = ("import os, sys; import xorl.cli.train; "
             "print('torch' in sys.modules, os.environ.get('PYTORCH_ALLOC_CONF'), "
             "os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    for extra, expected in (({}, "False expandable_segments:True None"),
                            ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}, "False max_split_size_mb:64 None"),
                            ({"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}, "False None backend:native")):
        got = subprocess.run([sys.executable, "-c", probe], env={**base, **extra}, capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert got.returncode == 0 and got.stdout.strip() == expected, (extra, got.stdout, got.stderr)
