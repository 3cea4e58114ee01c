"""What the examples/hf scripts share: the tiny default model and its tokenizer (no download)."""

from __future__ import annotations

import os

import torch


def byte_tokenizer():
    """A transformers tokenizer whose tokens are the UTF-8 bytes (ids 0-255, as xorl's byte tokenizer)
    and <s> 256, </s> 257, <pad> 258: byte-level BPE with no merges, built from nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_model_folder(folder: str) -> str:
    """A small random Llama-style model over those 259 tokens, with its tokenizer, written once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             bos_token_id=256, eos_token_id=257, pad_token_id=258)
        LlamaForCausalLM(config).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
    return folder
