"""The drop-in face of the models: ``from_pretrained(folder)`` and ``save_pretrained(model, folder)``.

    model = xorl.models.from_pretrained("/models/Llama-3.1-8B", dtype=torch.bfloat16)
    logits = model(input_ids).logits
    xorl.models.save_pretrained(model, "/out/llama-ft")      # transformers loads it

``weights=False`` builds from config.json alone, so ``with torch.device("meta"):`` gives the full
model without memory (parameter counts, planning). The folder's config.json is read exactly as a
training run reads it (xorl/config/model_path.py): what xorl cannot build exactly is refused naming the field.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

# What a model folder holds besides weights and config.json that a user expects to travel with it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
# config.json entries that are not architecture but that generation and tokenization read.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def model_config_from_folder(folder: str, **overrides):
    """The ``ModelConfig`` that ``folder``'s config.json defines (ValueError naming the problems)."""
    from xorl.config import ModelConfig
    from xorl.config.model_path import hf_model_fields

    values, problems = hf_model_fields(folder)
    if problems:
        raise ValueError(f"cannot build {folder!r}: " + "; ".join(problems))
    return ModelConfig(**{**values, "model_path": folder, **overrides})


def from_pretrained(folder: str, dtype: torch.dtype = torch.bfloat16, weights: bool = True, **overrides) -> nn.Module:
    """The xorl model of an HF folder (a plain nn.Module), on the current default device.

    ``overrides``: local fields (``merge_qkv``, ``attn_implementation``, ...) or training knobs.
    ``weights=False``: built from config.json alone (meta-device friendly; initialised weights otherwise).
    """
    from xorl.models.hf_reader import load_hf_weights
    from xorl.models.registry import build_model

    model = build_model(model_config_from_folder(folder, **overrides)).to(dtype)
    if weights:
        load_hf_weights(model, folder)
    return model


def save_pretrained(model: nn.Module, folder: str, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 5 * 10**9) -> None:
    """Write an HF folder transformers loads: safetensors, config.json, and the tokenizer files,
    token ids and generation_config.json of the folder the model came from (``model.config.model_path``)."""
    from xorl.models.hf_writer import save_hf_weights

    save_hf_weights(model, folder, model.config, max_shard_bytes=max_shard_bytes, dtype=dtype)
    source = getattr(model.config, "model_path", None)
    if source:
        copy_tokenizer_and_ids(source, folder)


def copy_tokenizer_and_ids(source: str, folder: str) -> list[str]:
    """Copy ``source``'s tokenizer files into ``folder``, keep its bos / eos / pad token ids in
    ``folder``'s config.json, and write generation_config.json (``source``'s, or one made from those
    ids). Returns the files written. Rank 0's job in a parallel run."""
    import json

    written = []
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(folder, name))
            written.append(name)
    ids = token_ids(source)
    config_path = os.path.join(folder, "config.json")
    if ids and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        config.update(ids)
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    generation = os.path.join(source, "generation_config.json")
    if os.path.isfile(generation):
        shutil.copyfile(generation, os.path.join(folder, "generation_config.json"))
    else:
        with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)
    return written + ["generation_config.json"]


def token_ids(folder: str) -> dict:
    """bos / eos / pad_token_id from ``folder``'s config.json (those present)."""
    import json

    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return {k: config[k] for k in TOKEN_ID_KEYS if k in config}
