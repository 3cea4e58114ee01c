"""The tokenizer comes with the model: a model folder's own tokenizer is used when
data.tokenizer is unset, its end-of-text token is the one the folder names, and exports carry the
tokenizer files, the token ids and generation_config.json."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import xorl.models  # noqa: E402
from xorl.config import load_config  # noqa: E402
from xorl.data.tokenizer import build_tokenizer  # noqa: E402
from xorl.observability.metrics import startup_summary  # noqa: E402

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "<s>", "<|eot|>", "<unk>"]


def model_folder(tmp_path, eos_in_tokenizer=True):
    """A tiny Llama folder with its own word-level tokenizer whose end-of-text token has an unusual
    name (<|eot|>), so it can only be found where the folder names it."""
    folder = tmp_path / "model"
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    kwargs = {"bos_token": "<s>", "unk_token": "<unk>"}
    if eos_in_tokenizer:
        kwargs["eos_token"] = "<|eot|>"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.save_pretrained(folder)
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=8,
                                      eos_token_id=9, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("eos_in_tokenizer", [True, False])
def test_model_folder_tokenizer_is_used_with_its_end_of_text_token(tmp_path, eos_in_tokenizer):
    folder = model_folder(tmp_path, eos_in_tokenizer)
    config = load_config(None, [f"--model.model_path={folder}"])
    assert config.data.tokenizer == str(folder)
    tok = build_tokenizer(config.data.tokenizer)
    assert tok.eos_id == WORDS.index("<|eot|>")  # from tokenizer_config.json, else config.json's eos_token_id
    assert tok.encode("the cat sat") == [0, 1, 2, tok.eos_id]
    summary = startup_summary(config, _OneProcess(), 1000, 0, "cpu")
    assert f"tokenizer {folder}" in summary and "data builtin" in summary


def test_an_explicit_tokenizer_wins(tmp_path):
    folder = model_folder(tmp_path)
    config = load_config(None, [f"--model.model_path={folder}", "--data.tokenizer=byte"])
    assert config.data.tokenizer == "byte"


def test_export_carries_tokenizer_ids_and_generation_config(tmp_path):
    folder = model_folder(tmp_path)
    model = xorl.models.from_pretrained(str(folder), dtype=torch.float32)
    out = tmp_path / "out"
    xorl.models.save_pretrained(model, str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(out / name), name
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (8, 9)
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id) == (8, 9)
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "<|eot|>"


class _OneProcess:
    world_size, dp, ep = 1, 1, 1
    mesh_shape = (1, 1, 1, 1, 1, 1)


@pytest.mark.slow
def test_a_transformers_folder_trains_under_torchrun_and_its_export_loads_back_with_its_tokenizer(tmp_path):
    """The user's path end to end: a folder written by transformers (weights + tokenizer), torchrun
    FSDP 2 from the command line with data in JSONL, export_hf; transformers then loads the export
    and its tokenizer, and gives the logits xorl's model gives on that folder, from trained weights."""
    from tests.support.cli_runs import torchrun

    folder = model_folder(tmp_path)
    g = torch.Generator().manual_seed(3)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(64):
            words = [WORDS[int(i)] for i in torch.randint(0, 8, (int(torch.randint(5, 20, (1,), generator=g)),),
                                                           generator=g)]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    run = tmp_path / "run"
    result = torchrun(2, "--model.model_path", str(folder), "--data.dataset", str(tmp_path / "data.jsonl"),
                      "--data.seq_len=16", "--train.max_steps=3", "--train.warmup_steps=1", "--train.lr=1e-2",
                      "--train.data_parallel_shard_size=2", f"--train.output_dir={run}", "--train.export_hf=true",
                      cwd=tmp_path)
    assert result.code == 0, result.text[-3000:]
    assert f"tokenizer {folder}" in result.text  # the folder's own tokenizer, said in the start-up lines

    export = run / "hf"
    tok = transformers.AutoTokenizer.from_pretrained(export)
    assert tok.eos_token == "<|eot|>"
    ids = torch.tensor([tok("the cat sat on a mat")["input_ids"]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ours = xorl.models.from_pretrained(str(export), dtype=torch.float32).eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        got, ref, before = ours(ids), hf(ids).logits, start(ids).logits
    got = got.logits if hasattr(got, "logits") else got
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    assert float((ref - before).norm() / before.norm()) > 1e-3  # the export holds the trained weights
